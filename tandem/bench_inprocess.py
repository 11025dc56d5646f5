"""`tandem bench inprocess`: the served round in ONE process.

The same engines, servicers and round as the served cluster (the gateway's Scheduler over the target and
draft servicers, tandem/inprocess.py), placed as `tandem serve` places them (target on cuda:0, draft on
cuda:1 when there are two GPUs), but no gRPC, no gateway process and no bridge: messages are handed over
as objects and hidden rows as tensors. Continuous batching as the gateway does it: up to `batch` requests
run, a finished one is replaced by the next prompt before the following round. Served tokens/s divided by
these tokens/s is the cost of the split. The engines run on the served services' torch thread count (one: their
host work, and on a CPU their compute), so the two sides differ only by the split.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import time
from dataclasses import dataclass, field

import torch

from services.draft.engine import DraftEngine
from services.target.engine import TargetEngine
from tandem.bench import SEED_BASE, write_results


def service_devices(device: str) -> tuple[str, str]:
    """(target, draft) devices as `tandem serve --device` picks them."""
    from tandem.serve import placement
    return placement(argparse.Namespace(device=device, draft_device="", hidden_transport="auto"))


def make_engines(model: str, device: str = "cpu", dtype: str | None = None, num_blocks: int = 2048,
                 synthetic_acceptance: tuple[float, ...] | None = None, eager: bool = False,
                 quantization: str = "auto", draft_quantization: str = "",
                 graph_batch: int = 64) -> tuple[TargetEngine, DraftEngine]:
    """Target and draft engines placed and built as the services build them (services/launch.py); the draft's
    quantization defaults to the target's."""
    from models.model import DraftModel, TargetModel
    from services.config import DTYPES
    from services.launch import build_engine
    dt = DTYPES[dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    t_dev, d_dev = service_devices(device)
    te, de = (build_engine(engine_cls, model_cls, model, dev, dt, num_blocks=num_blocks, graphs=not eager,
                           graph_batch=graph_batch, what="tandem bench inprocess",
                           quantization=q)                  # graphs captured now (up to graph_batch), as served
              for engine_cls, model_cls, dev, q in ((TargetEngine, TargetModel, t_dev, quantization),
                                                    (DraftEngine, DraftModel, d_dev, draft_quantization or quantization)))
    te.synthetic_acceptance = synthetic_acceptance
    return te, de


@dataclass
class LoopResult:
    outputs: dict[int, list[int]]            # prompt index -> its max_tokens output tokens
    wall_s: float
    rounds: int
    drafts: int = 0                          # (request, round) pairs that proposed >= 1 draft
    accepted: int = 0
    split: dict[str, float] = field(default_factory=dict)   # seconds: prefill, propose, verify, loop

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())


def run_loop(te: TargetEngine, de: DraftEngine | None, prompts: list[list[int]], k: int, batch: int,
             max_tokens: int) -> LoopResult:
    """Greedy decoding of every prompt, `batch` at a time, K drafts per round (0: target only), by the
    gateway's Scheduler over this process's servicers (tandem/inprocess.py)."""
    from gateway.request import Observer
    from tandem.inprocess import generate_all, servicer_stubs

    class Split(Observer):
        def __init__(self):
            self.split, self.rounds = dict(prefill=0.0, propose=0.0, verify=0.0, gateway=0.0), 0

        def phase(self, name, seconds):
            self.split[name] = self.split.get(name, 0.0) + seconds

        def round_split(self, seconds):
            self.rounds += 1
            for name in ("propose", "verify", "gateway"):
                self.split[name] += seconds.get(name, 0.0)
    if not hasattr(te, "_inprocess_stubs"):               # one pair of servicers per engine pair
        te._inprocess_stubs = servicer_stubs(te, de)
    target, draft = te._inprocess_stubs
    obs = Split()
    t0 = time.perf_counter()
    seeds = [SEED_BASE + i for i in range(len(prompts))]           # as the served bench seeds them
    reqs, events = asyncio.run(generate_all(target, draft if k > 0 else None, prompts, k, batch, max_tokens, obs,
                                            seeds))
    wall = time.perf_counter() - t0
    for r, ev in zip(reqs, events):
        if ev[-1].error is not None:
            raise RuntimeError(f"request {r.id} failed in process: {ev[-1].error}")
    obs.split["loop"] = wall - sum(obs.split.values())
    return LoopResult({i: list(r.output_ids[:max_tokens]) for i, r in enumerate(reqs)}, wall, obs.rounds,
                      sum(r.stats.num_drafts for r in reqs), sum(r.stats.num_accepted_tokens for r in reqs), obs.split)


def measure(te, de, prompts, k, batch, max_tokens) -> dict:
    """One warm-up pass over `batch` prompts and the others for 2 tokens (prefix caches as in
    tandem.bench_served.run_served), then the timed pass over all -> a result row."""
    run_loop(te, de, prompts[:batch], k, batch, max_tokens)
    if prompts[batch:]:
        run_loop(te, de, prompts[batch:], k, batch, 2)
    r = run_loop(te, de, prompts, k, batch, max_tokens)
    per_round = {name: 1000 * s / max(r.rounds, 1) for name, s in r.split.items()}
    return {"k": k, "batch": batch, "tokens": r.tokens, "wall_s": r.wall_s, "tokens_per_s": r.tokens / r.wall_s,
            "rounds": r.rounds, "mean_acceptance_length": 1 + r.accepted / r.drafts if r.drafts else 1.0,
            "ms_per_round": per_round, "outputs": r.outputs}


def main(argv=None) -> int:
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem bench inprocess", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--random-config", default="", help="a models/presets.py preset with random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda (target cuda:0, draft cuda:1 if present)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--synthetic-acceptance", default="", help="BENCHMARK ONLY: accept each draft with probability "
                   "P, or P1,P2,... per position (greedy; changes the output; services/target/synthetic.py)")
    p.add_argument("--quantization", default="auto", help="auto | none | fp8 (tandem serve --help)")
    p.add_argument("--draft-quantization", default="", help="the draft's (default: --quantization)")
    p.add_argument("--ks", default="0,3")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--requests-per-batch", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--out", default="results/inprocess")
    a = p.parse_args(argv)
    model = random_id(a) or str(a.model or default_model())
    rows = run_grid(model, a)
    write_results(a.out, "inprocess", None, [{k: v for k, v in r.items() if k != "outputs"} for r in rows])
    for r in rows:
        print(f"batch {r['batch']:3d} K={r['k']}: {r['tokens_per_s']:9.1f} tok/s  MAL {r['mean_acceptance_length']:.2f}")
    return 0


def random_id(a) -> str | None:
    from models.presets import random_model_id
    return random_model_id(a.random_config, a.seed) if a.random_config else None


def grid_engines(model: str, a, profile: str | None = None) -> tuple[TargetEngine, DraftEngine]:
    """The engines of a's grid with synthetic acceptance `profile` (default a.synthetic_acceptance), on the served
    services' torch thread count."""
    from services.config import ServiceConfig
    from services.target.synthetic import parse_profile
    torch.set_num_threads(ServiceConfig.threads)   # as served: each service's host work on that many threads
    synth = parse_profile(a.synthetic_acceptance if profile is None else profile)
    return make_engines(model, a.device, a.dtype, synthetic_acceptance=synth,
                        quantization=getattr(a, "quantization", "auto"),
                        draft_quantization=getattr(a, "draft_quantization", ""))


def run_grid(model: str, a, profile: str | None = None) -> list[dict]:
    """Every (batch, K) of a's grid in this process (ks, batches, requests_per_batch, max_tokens, ...), with
    synthetic acceptance `profile` (default a.synthetic_acceptance): a.repeats (default 1) rows a (batch, K), the
    grid's Ks interleaved and their order reversed every other repeat, as the served rows are measured."""
    from tandem.bench import bench_prompts
    te, de = grid_engines(model, a, profile)
    ks = [int(x) for x in str(a.ks).split(",")]
    rows = []
    for b in (int(x) for x in str(a.batches).split(",")):
        prompts = bench_prompts(model, b * a.requests_per_batch, a.prompt_tokens, seed=b)
        for rep in range(max(1, getattr(a, "repeats", 1))):
            for k in (ks if rep % 2 == 0 else ks[::-1]):
                rows.append(measure(te, de, prompts, k, b, a.max_tokens))
    del te, de
    gc.collect()                    # the engines hold reference cycles: free their memory before a served run starts
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows
