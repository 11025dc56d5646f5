"""`tandem bench steps`: the cost of one MTP draft step against one target step, per batch size.

Times the two forwards a speculative round is made of, in this process, with the serving code's models and
paged KV cache (CUDA graphs on a GPU, as the services capture them): a target step (1 token per request: a
K = 0 decode step; and K + 1 tokens per request: a verify step) and one MTP draft step (1 token and 1 target
hidden row per request), each with its LM head and greedy pick. The model is a checkpoint (--model) or
random weights of `tandem train`'s shape with --arch overrides, so candidate shapes are compared before any
training. The ratio draft / target decode step is what bounds speculation: a round of K drafts costs
K x draft + verify instead of one target step per token. `chain` is the draft's K-token chain as the draft
service runs it (services/draft/chain.py: K LM heads and choices, K - 1 MTP steps, one replay on a GPU), so
chain / K is a served draft step. --kernels adds, per step, the device's kernels (launches and microseconds a
step, torch.profiler), to see what a step is made of before shrinking it.

    tandem bench steps --arch num_hidden_layers=12 --arch hidden_size=192 --batches 1,8,32
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from models.config import ModelConfig
from models.loader import build, load_model
from models.model import DraftModel, TargetModel
from models.runner import new_cache
from models.tiny import init_random_
from services.draft.chain import DraftChain


def random_models(arch: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """(target, draft, config dict) of `tandem train`'s architecture with `arch` overrides, random weights."""
    from tandem.train import ARCH, TrainConfig, model_config
    raw = model_config(TrainConfig(arch={**ARCH, **arch}))
    cfg = ModelConfig.from_dict(raw)
    models = [init_random_(build(cls, cfg), seed + i).to(device, dtype) for i, cls in enumerate((TargetModel, DraftModel))]
    return models[0], models[1], raw


def checkpoint_models(path: str, device: str, dtype: torch.dtype):
    return (load_model(TargetModel, path, dtype=dtype, device=device),
            load_model(DraftModel, path, dtype=dtype, device=device), json.loads((Path(path) / "config.json").read_text()))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_steps(steps: dict, device: str, iters: int) -> dict[str, float]:
    """Median ms of each step() over iters rounds after 3 warm-up rounds, the steps taking turns within a
    round (each call ends in a host read). On a GPU wall time; on the CPU this process's CPU time (torch on
    one thread: the step's own work, not the time other processes of a busy machine take from it)."""
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    times = {name: [] for name in steps}
    for i in range(iters + 3):
        for name, step in steps.items():
            _sync(device)
            t0 = clock()
            step()
            if i >= 3:
                times[name].append(clock() - t0)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def measure(target, draft, device: str, batch: int, context: int, k: int, iters: int, graphs: bool,
            kernels: bool = False) -> dict:
    """ms of a target decode step, a verify step (k + 1 tokens) and one draft step, `batch` requests at
    `context` cached positions each, and the draft's chain of k tokens; every step's cache writes are rolled
    back after it. kernels: each step's kernel_table too."""
    D, V = target.cfg.hidden_size, target.cfg.vocab_size
    tc, dc = new_cache(target, num_blocks=batch * (context // 16 + 4) + 8), new_cache(draft, num_blocks=batch * (context // 16 + 4) + 8)
    tf, df = target, draft
    if graphs and device.startswith("cuda"):
        from models.cuda_graphs import GraphedForward
        tf = GraphedForward(target, tc, D, tc.ckv.dtype, context + 64, max_tokens=max(64, batch * (k + 1)))
        df = GraphedForward(draft, dc, D, dc.ckv.dtype, context + 64, max_tokens=max(64, batch), extra_rows=1)
    ids = [f"r{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(batch)
    with torch.inference_mode():
        for r in ids:                                       # fill both caches to `context` positions
            tc.allocate(r), dc.allocate(r)
            toks = torch.randint(3, V, (context,), generator=g).to(device)
            h = target(toks, tc.prepare([r], [context]), tc)                            # [context, D]
            draft(toks, h, dc.prepare([r], [context]), dc)

    def target_step(n: int):
        def run():
            with torch.inference_mode():
                toks = torch.randint(3, V, (batch * n,), generator=g).to(device)       # [B*n]
                h = tf(toks, tc.prepare(ids, [n] * batch), tc)                         # [B*n, D]
                target.compute_logits(h).argmax(-1).cpu()
            [tc.rollback(r, n) for r in ids]
        return run

    hidden = torch.randn(batch, D, generator=g).to(device, next(draft.parameters()).dtype)   # [B, D]

    def draft_step():
        with torch.inference_mode():
            toks = torch.randint(3, V, (batch,), generator=g).to(device)                # [B]
            h = df(toks, hidden, dc.prepare(ids, [1] * batch), dc)                     # [B, D]
            draft.compute_logits(h).argmax(-1).cpu()
        [dc.rollback(r, 1) for r in ids]
    chain = DraftChain(draft, dc, context + 64, k, graphs=graphs and device.startswith("cuda"))

    def chain_round():
        with torch.inference_mode():
            chain.run(ids, hidden, [k] * batch)                                        # k drafts a request
        [dc.rollback(r, k - 1) for r in ids]
    steps = dict(target=target_step(1), verify=target_step(k + 1), draft=draft_step, chain=chain_round)
    ms = time_steps(steps, device, iters)
    out = dict(batch=batch, context=context, k=k, **{f"{name}_ms": v for name, v in ms.items()})
    out["draft_over_target"] = out["draft_ms"] / out["target_ms"]
    out["draft_over_verify"] = out["draft_ms"] / out["verify_ms"]
    out["chain_step_over_target"] = out["chain_ms"] / k / out["target_ms"]
    if kernels:
        out["kernels"] = {name: kernel_table(step, device) for name, step in steps.items()}
    return out


def kernel_table(step, device: str, runs: int = 10) -> list[tuple[str, float, float]]:
    """[(kernel, launches a step, device us a step)] of `runs` calls of step(), most time first (torch.profiler;
    on a CPU its operators)."""
    cuda = device.startswith("cuda")
    acts = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    step()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            step()
        _sync(device)
    rows = [(e.key, e.count / runs, (e.self_device_time_total if cuda else e.self_cpu_time_total) / runs)
            for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    return sorted(rows, key=lambda r: -r[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: random weights, --arch)")
    p.add_argument("--arch", action="append", default=[], metavar="KEY=JSON", help="tandem train's --arch overrides")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=128, help="cached positions per request")
    p.add_argument("-k", type=int, default=3, help="verify step of k + 1 tokens per request")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on a GPU")
    p.add_argument("--kernels", action="store_true", help="each step's kernels: launches and device us a step")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the services use 1)")
    p.add_argument("--top", type=int, default=15, help="kernels listed a step (--kernels)")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    arch = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.arch)}
    target, draft, raw = (checkpoint_models(a.model, a.device, dtype) if a.model
                          else random_models(arch, a.device, dtype))
    n_t, n_d = sum(x.numel() for x in target.parameters()), sum(x.numel() for x in draft.mtp.parameters())
    print(f"{a.model or 'random'}: {raw['num_hidden_layers']} layers, hidden {raw['hidden_size']}, target {n_t:,} "
          f"parameters + MTP layer {n_d:,}; {a.device} {dtype}", flush=True)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        r = measure(target, draft, a.device, b, a.context, a.k, a.iters, not a.eager, a.kernels)
        rows.append(dict(r, arch=arch, model=a.model or "random", device=a.device, dtype=str(dtype).split(".")[-1],
                         target_params=n_t, mtp_params=n_d))
        print(f"batch {b:3d}: target step {r['target_ms']:.3f} ms, verify ({a.k + 1} tokens) {r['verify_ms']:.3f} ms, "
              f"draft step {r['draft_ms']:.3f} ms -> draft/target {r['draft_over_target']:.3f}, "
              f"draft/verify {r['draft_over_verify']:.3f}; chain of {a.k} {r['chain_ms']:.3f} ms -> a chained step / "
              f"target {r['chain_step_over_target']:.3f}", flush=True)
        for name, table in r.get("kernels", {}).items():
            what = "kernels" if a.device.startswith("cuda") else "operators"
            print(f"  {name}: {sum(n for _, n, _ in table):.0f} {what}, {sum(us for *_, us in table):.1f} us a step")
            for key, n, us in table[:a.top]:
                print(f"    {us:9.1f} us {n:6.1f}x  {key[:100]}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
