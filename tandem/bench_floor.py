"""`tandem bench floor`: the target's verify step against its memory-bandwidth floor.

Per (batch B, K): B requests of --prompt-tokens tokens are prefilled, then TargetEngine.verify runs
over K random drafts each (B x (K+1) rows), timed (CUDA events on a GPU; median after warm-up).
Its floor is the bytes it must read divided by the device's copy bandwidth, measured in the same
run (a large device-to-device copy, bytes read + written / time):
  weights: every dense parameter (attention, norms, dense MLPs, shared experts, routers), the routed
  experts the routers actually picked in that step (counted per layer by hooks on the routers),
  the embedding rows of the step's distinct tokens and the whole LM head;
  KV: per layer, each request's cached positions x (kv_lora_rank + qk_rope_head_dim) elements.
time / floor says how far the step is from what the memory system allows (docs/DESIGN.md, "Floors and the roofline").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.bench import write_results


def copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> float:
    """Bytes read + written per second of a device-to-device copy (median of `iters`)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = [_timed(lambda: y.copy_(x), device) for _ in range(iters + 3)][3:]
    return 2 * nbytes / statistics.median(times)


def _timed(fn, device: str) -> float:
    """Seconds fn takes on `device` (CUDA events on a GPU)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class ExpertCounter:
    """Hooks on every MoE router: distinct experts picked per layer in the last forward."""

    def __init__(self, model):
        from models.moe import MoE
        self.touched: dict[str, set[int]] = {}
        self.expert_bytes, self.active = 0, True
        for name, m in model.named_modules():
            if isinstance(m, MoE):
                m.gate.register_forward_hook(self._hook(name))
                e = next(iter(m.experts.values()))
                self.expert_bytes = sum(p.numel() * p.element_size() for p in e.parameters())

    def _hook(self, name):
        def hook(_module, _inputs, output):
            ids = output[1]                                     # a host read: never in a capture (CPU torch has none)
            if self.active and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.touched.setdefault(name, set()).update(ids.flatten().tolist())
        return hook

    def bytes_read(self) -> int:
        return self.expert_bytes * sum(len(s) for s in self.touched.values())


def static_bytes(model) -> tuple[int, int, int]:
    """(dense parameter bytes without routed experts, embedding and LM head; one embedding row; LM head)."""
    dense = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name or name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            continue
        dense += p.numel() * p.element_size()
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    return dense, emb.shape[1] * emb.element_size(), head.numel() * head.element_size()


def measure(engine, batch: int, k: int, prompt_tokens: int, warmup: int, iters: int, bw: float, seed: int) -> dict:
    from services.sampling import Sampling
    cfg, model = engine.model.cfg, engine.model
    device = str(engine.cache.device)
    g = torch.Generator().manual_seed(seed)
    ids = [f"floor-{batch}-{k}-{i}" for i in range(batch)]
    engine.prefill([(r, torch.randint(cfg.vocab_size, (prompt_tokens,), generator=g).tolist(), Sampling())
                    for r in ids])
    counter = ExpertCounter(model) if not hasattr(model, "_floor_counter") else model._floor_counter
    model._floor_counter = counter
    dense, emb_row, head = static_bytes(model)
    kv_elem = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * engine.cache.ckv.element_size()
    times, floors, experts = [], [], []
    # warm-up steps run eagerly and count the experts the router touches; timed steps run as served
    # (CUDA graphs on a GPU, where hooks do not fire) and are charged the warm-up's mean expert bytes
    graphed, engine.forward = engine.forward, model
    counted = []
    for it in range(warmup + iters):
        drafts = [torch.randint(cfg.vocab_size, (k,), generator=g).tolist() for _ in ids]
        context = sum(engine.requests[r].num_tokens + k for r in ids)            # positions attended
        distinct = len({t for d in drafts for t in d} | {engine.requests[r].pending_token for r in ids})
        counter.touched.clear()
        if it == warmup:
            engine.forward, counter.active = graphed, False
            engine.verify([(r, d, None) for r, d in zip(ids, drafts)])         # capture, untimed
        t = _timed(lambda: engine.verify([(r, d, None) for r, d in zip(ids, drafts)]), device)
        if it < warmup:
            counted.append((counter.bytes_read(), sum(len(s) for s in counter.touched.values())
                            / max(len(counter.touched), 1)))
        expert_bytes = statistics.mean(c[0] for c in counted)
        nbytes = (dense + expert_bytes + distinct * emb_row + head + model.num_cache_layers * context * kv_elem)
        if it >= warmup:
            times.append(t)
            floors.append(nbytes / bw)
            experts.append(statistics.mean(c[1] for c in counted))
    engine.forward, counter.active = graphed, True
    engine.release(ids)
    t, floor = statistics.median(times), statistics.median(floors)
    return {"batch": batch, "k": k, "rows": batch * (k + 1), "ms": 1000 * t, "floor_ms": 1000 * floor,
            "ratio": t / floor, "mb_read": floor * bw / 1e6, "experts_per_layer": statistics.mean(experts)}


def table(rows: list[dict], bw: float) -> str:
    lines = [f"Device copy bandwidth (read + written): {bw / 1e12:.3f} TB/s", "",
             "| batch | K | rows | verify ms (median) | MB read | experts / MoE layer | floor ms | time / floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['k']} | {r['rows']} | {r['ms']:.3f} | {r['mb_read']:.1f} | "
              f"{r['experts_per_layer']:.1f} | {r['floor_ms']:.3f} | {r['ratio']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    from services.launch import build_engine
    from models.model import TargetModel
    from models.presets import random_model_id
    from services.config import DTYPES
    from services.target.engine import TargetEngine
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem bench floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--random-config", default="", help="a random-weight preset (models/presets.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--quantization", default="auto", help="auto | none | fp8 (tandem serve --help)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ks", default="0,3")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=0, help="size of the bandwidth copy (default: 2048 on a GPU, 64 on cpu)")
    p.add_argument("--enforce-eager", action="store_true", help="time eager steps (default on a GPU: CUDA graphs)")
    p.add_argument("--out", default="results/floor")
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error(f"--warmup must be >= 1 (the warm-up steps count the experts), got {a.warmup}")
    device = "cuda:0" if a.device == "cuda" else a.device
    dtype = DTYPES[a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    model_id = random_model_id(a.random_config, a.seed) if a.random_config else str(a.model or default_model())
    bw = copy_bandwidth(device, (a.copy_mib or (2048 if device.startswith("cuda") else 64)) << 20)
    batches, ks = [int(x) for x in a.batches.split(",")], [int(x) for x in a.ks.split(",")]
    blocks = max(batches) * -(-(a.prompt_tokens + (a.warmup + a.iters) * (max(ks) + 1) + 16) // 16) + 8
    engine = build_engine(TargetEngine, TargetModel, model_id, device, dtype, num_blocks=blocks,   # as served
                          max_model_len=1 << 30, graphs=not a.enforce_eager, graph_batch=0, what="tandem bench floor",
                          quantization=a.quantization)
    model = engine.model
    rows = [measure(engine, b, k, a.prompt_tokens, a.warmup, a.iters, bw, seed=b * 100 + k)
            for b in batches for k in ks]
    params = sum(p.numel() for p in model.parameters())
    md = (f"Verify step vs floor: {model_id} ({params / 1e6:.1f} M parameters, {str(dtype)[6:]}) on {device}, "
          f"{a.prompt_tokens}-token contexts, {time.strftime('%Y-%m-%d')}\n`tandem bench floor {' '.join(argv or [])}`"
          "\n\n" + table(rows, bw) + "\n")
    write_results(a.out, "floor", md, {"copy_bandwidth_bytes_per_s": bw, "rows": rows})
    return 0
