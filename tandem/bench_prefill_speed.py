"""`tandem bench prefill-speed`: prefill throughput of the target per attention path against its FLOP floor, in
this process (issue 17).

Per --lengths L and --paths path: one request's L-token prompt (random ids, no prefix cache) is prefilled whole
by TargetEngine.prefill (the forward over L rows, the LM head of the last row, the first token sampled), timed
on the device: the median of --iters after one warm-up per path (compiles, autotuning). Paths:
  old-triton      TANDEM_PREFILL=off TANDEM_ATTENTION=triton: the paged kernel, one program per query row
  old-flashinfer  TANDEM_PREFILL=off TANDEM_ATTENTION=flashinfer: FlashInfer's paged MLA (where it imports)
  absorbed        TANDEM_PREFILL=absorbed: the flash-style kernel over the latent cache (kernels/triton_mla_prefill.py)
  expanded        TANDEM_PREFILL=expanded: per-head K / V up-projected, then SDPA (kernels/mla_expanded.py)
The floor is the forward's FLOPs at --peak-tflops (790: the H200's dense bf16), `forward_flops`: per token the
attention projections (q or q-LoRA, kv_a, kv_b's up-projection, o), the dense MLPs, per MoE layer the router,
the top-k routed experts and the shared ones; per causal (query, key) pair and head qk + v multiply-adds (the
expanded form's count, the smaller); the LM head of the last row; two FLOPs a multiply-add.

A second table times the attention alone: one layer's call per path on random queries over a cache of L keys
(one request, the model's head / rank shapes), which is what decides absorbed against expanded.

    tandem bench prefill-speed --device cuda --random-config v2-lite-yarn --lengths 1024,8192,32768
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from tandem.bench import write_results
from tandem.bench_floor import _timed

PATHS = {"old-triton": {"TANDEM_PREFILL": "off", "TANDEM_ATTENTION": "triton"},
         "old-flashinfer": {"TANDEM_PREFILL": "off", "TANDEM_ATTENTION": "flashinfer"},
         "absorbed": {"TANDEM_PREFILL": "absorbed"}, "expanded": {"TANDEM_PREFILL": "expanded"}}


def forward_flops(cfg, n: int, start: int = 0) -> float:
    """FLOPs of a target forward over n prompt positions after `start` cached ones, with the LM head of one row."""
    D, h, R, P = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, qk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    q = D * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else D * h * qk
    proj = q + D * (R + P) + R * h * (nope + v) + h * v * D                   # per token, per layer
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    mlp = sum(D * cfg.n_routed_experts + 3 * D * cfg.moe_intermediate_size
              * (cfg.num_experts_per_tok + cfg.n_shared_experts) if m else 3 * D * cfg.intermediate_size for m in moe)
    pairs = n * start + n * (n + 1) // 2                                      # causal (query, key) pairs
    macs = n * (cfg.num_hidden_layers * proj + mlp) + cfg.num_hidden_layers * pairs * h * (qk + v)
    return 2.0 * (macs + D * cfg.vocab_size)


@contextlib.contextmanager
def env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def usable(path: str, device: str) -> str | None:
    """None, or why this path cannot run here."""
    from kernels import flashinfer_mla
    if path == "old-flashinfer" and not (device.startswith("cuda") and flashinfer_mla.available()):
        return "flashinfer does not import"
    return None


def prefill_seconds(engine, length: int, iters: int, seed: int) -> list[float]:
    from services.sampling import Sampling
    g = torch.Generator().manual_seed(seed)
    device, out = str(engine.cache.device), []
    for i in range(iters):
        prompt = torch.randint(3, engine.vocab_size, (length,), generator=g).tolist()
        out.append(_timed(lambda: engine.prefill([(f"p{i}", prompt, Sampling())]), device))
        engine.release([f"p{i}"])
    return out


def attention_ms(cfg, device: str, dtype: torch.dtype, length: int, path: str, iters: int = 3) -> float:
    """One layer's attention over one request of `length` rows on `path` (random values), median ms."""
    from kernels import dispatch
    from models.kv_cache import PagedKVCache
    h, R, P, nope, v = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                        cfg.v_head_dim)
    cache = PagedKVCache(1, -(-length // 16) + 1, 16, R, P, dtype=dtype, device=device)
    cache.ckv.normal_()
    cache.kpe.normal_()
    cache.allocate("a")
    batch = cache.prepare(["a"], [length])
    q_nope, q_pe = (torch.randn(length, h, d, device=device, dtype=dtype) for d in (nope, P))
    w_kv = torch.randn(h, nope + v, R, device=device, dtype=dtype) / R ** 0.5
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_kv[:, :nope])
    ckv, kpe, scale = cache.ckv[0], cache.kpe[0], cfg.softmax_scale
    call = {"expanded": lambda: dispatch.expanded_attention(q_nope, q_pe, batch, ckv, kpe, w_kv, scale),
            "absorbed": lambda: dispatch.prefill_attention(q_lat, q_pe, batch, ckv, kpe, scale)}.get(
        path, lambda: dispatch.paged_attention(q_lat, q_pe, batch, ckv, kpe, scale))
    with env(PATHS[path]), torch.inference_mode():
        call()                                                                   # compile / autotune / plan
        return 1000 * statistics.median(_timed(call, device) for _ in range(iters))


def tables(model_id: str, rows: list[dict], attn: list[dict], peak: float) -> str:
    lines = [f"Prefill of one prompt, whole: {model_id}, {time.strftime('%Y-%m-%d')}; floor = FLOPs / {peak:g} "
             "TFLOP/s (bf16 dense)", "",
             "| tokens | path | prefill s (median) | tokens/s | TFLOP | floor s | time / floor |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['tokens']} | {r['path']} | {r['error']} | | | | |")
            continue
        lines.append(f"| {r['tokens']} | {r['path']} | {r['s']:.3f} | {r['tokens'] / r['s']:,.0f} | "
                     f"{r['flops'] / 1e12:.1f} | {r['floor_s']:.3f} | {r['s'] / r['floor_s']:.1f} |")
    best = {}
    for r in rows:
        if not r.get("error") and r["s"] < best.get(r["tokens"], (None, 1e30))[1]:
            best[r["tokens"]] = (r["path"], r["s"])
    lines += ["", "Fastest: " + ", ".join(f"{t} tokens: **{p}**" for t, (p, _) in best.items()), "",
              "Attention alone, one layer, one request (ms, median of 3):", "",
              "| tokens | " + " | ".join(PATHS) + " | fastest |", "|---|" + "---|" * (len(PATHS) + 1)]
    for length in sorted({a["tokens"] for a in attn}):
        got = {a["path"]: a for a in attn if a["tokens"] == length}
        ok = {p: a["ms"] for p, a in got.items() if a.get("ms") is not None}
        cells = [f"{got[p]['ms']:.2f}" if p in ok else got.get(p, {}).get("error", "-") for p in PATHS]
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {min(ok, key=ok.get) if ok else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from models.model import TargetModel
    from models.presets import model_config, random_model_id
    from services.config import DTYPES
    from services.launch import build_engine
    from services.target.engine import TargetEngine
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem bench prefill-speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--random-config", default="", help="a random-weight preset (models/presets.py)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--lengths", default="1024,8192,32768", help="prompt tokens")
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument("--iters", default="5,3,1", help="timed prefills per length (the last repeats)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the device (H200: 790)")
    p.add_argument("--out", default="results/prefill-speed")
    a = p.parse_args(argv)
    device = "cuda:0" if a.device == "cuda" else a.device
    dtype = DTYPES[a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    lengths, paths = [int(x) for x in a.lengths.split(",")], a.paths.split(",")
    iters = [int(x) for x in a.iters.split(",")]
    iters += [iters[-1]] * len(lengths)
    bad = [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"--paths: unknown {bad}, expected of {list(PATHS)}")
    model_id = random_model_id(a.random_config, 0) if a.random_config else str(a.model or default_model())
    positions = model_config(model_id).max_position_embeddings
    if max(lengths) >= positions:
        p.error(f"{model_id} holds {positions} positions; --lengths asks {max(lengths)} "
                "(v2-lite-yarn: V2-Lite's shapes with its YaRN context)")
    engine = build_engine(TargetEngine, TargetModel, model_id, device, dtype, num_blocks=-(-max(lengths) // 16) + 8,
                          max_model_len=max(lengths) + 1, graphs=False, what="tandem bench prefill-speed")
    rows, attn = [], []
    for i, length in enumerate(lengths):                   # every path at a length before the next length
        for path in paths:
            rows.append(measure(engine, path, length, iters[i], warm=i == 0, peak=a.peak_tflops, attn=attn))
            print(rows[-1], flush=True)
        write_results(a.out, "prefill-speed", tables(model_id, rows, attn, a.peak_tflops),   # after each length
                      {"rows": rows, "attention": attn})
    return 0


def measure(engine, path: str, length: int, iters: int, warm: bool, peak: float, attn: list) -> dict:
    """One (path, length) row of the prefill table; appends its attention-alone entry to `attn`."""
    cfg, device, dtype = engine.model.cfg, str(engine.cache.device), engine.cache.ckv.dtype
    row = {"tokens": length, "path": path, "flops": forward_flops(cfg, length)}
    row["floor_s"] = row["flops"] / (peak * 1e12)
    try:
        why = usable(path, device)
        if why:
            raise RuntimeError(why)
        with env(PATHS[path]):
            if warm:
                prefill_seconds(engine, length, 1, seed=99)                          # compiles, autotuning
            row["s"] = statistics.median(prefill_seconds(engine, length, iters, seed=length))
        attn.append({"tokens": length, "path": path, "ms": attention_ms(cfg, device, dtype, length, path)})
    except Exception as e:                          # one path failing (e.g. out of memory) leaves the others
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        attn.append({"tokens": length, "path": path, "error": type(e).__name__})
        engine.release([f"p{j}" for j in range(iters)])
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row
