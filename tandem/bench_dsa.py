"""`tandem bench dsa`: DeepSeek-V3.2 sparse attention against dense attention at long contexts, in one run.

A V3.2-shape random model (default the `v32-slice` preset: DeepSeek-V3.2's layer shapes, 3 layers) on one
device; per context length and batch, B requests whose caches hold `context` random positions (latent,
roped key and indexer key: the values do not change the cost), then verify steps of K + 1 new tokens per
request (forward + LM head), as the target runs them: CUDA graphs on a GPU (`--enforce-eager`: eager),
with the indexer on (sparse: each query reads its top index_topk keys) and off (dense: every key). Also
one layer's attention alone, where the two differ most. Medians after warm-up, CUDA events.

Byte floor of the attention core (the part that reads keys) per request and layer: dense reads every latent
key once, context x (R + P) x 2 bytes; sparse reads every index key (D_idx bytes + a 4-byte scale in
deployed scoring, 2 x D_idx in exact) and the selected latent keys (up to (K + 1) x index_topk of them).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from infra.defaults import NUM_SPECULATIVE_TOKENS

from tandem.bench import write_results
from tandem.bench_floor import _timed, copy_bandwidth


def fill_requests(cache, batch: int, context: int, seed: int) -> list[str]:
    """B requests holding `context` positions of random cache contents."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    for t in (cache.ckv, cache.kpe) + ((cache.index_k,) if cache.index_k is not None else ()):
        t.copy_(torch.randn(t.shape, generator=g, device=cache.device, dtype=torch.float32).to(t.dtype))
    if cache.index_scale is not None:
        cache.index_scale.fill_(2.0 ** -6)
    ids = [f"dsa-{i}" for i in range(batch)]
    for r in ids:
        cache.allocate(r)
        cache.extend(r, context)
    return ids


def time_steps(model, cache, fwd, ids, k: int, warmup: int, iters: int, seed: int) -> float:
    """Median seconds of a verify step (forward + LM head over B x (K + 1) rows); the cache is rolled back."""
    g = torch.Generator().manual_seed(seed)
    times = []
    for it in range(warmup + iters):
        batch = cache.prepare(ids, [k + 1] * len(ids))
        tokens = torch.randint(model.cfg.vocab_size, (batch.num_tokens,), generator=g).to(cache.device)
        t = _timed(lambda: model.compute_logits(fwd(tokens, batch, cache)), str(cache.device))
        for r in ids:
            cache.rollback(r, k + 1)
        if it >= warmup:
            times.append(t)
    return statistics.median(times)


def time_attention(model, cache, ids, k: int, warmup: int, iters: int) -> float:
    """Median seconds of layer 0's attention alone (indexer included) over the same step shape; on a GPU
    replayed from a CUDA graph (Triton kernels), so that host launch time is not counted."""
    attn = model.model.layers[0].self_attn
    x = torch.randn(len(ids) * (k + 1), model.cfg.hidden_size, device=cache.device, dtype=cache.ckv.dtype)
    batch = cache.prepare(ids, [k + 1] * len(ids))          # the same step replayed: it rewrites its own keys
    run = lambda: attn(x, batch, cache.layer(0))
    if cache.device.type == "cuda":
        batch.attention_backend = "triton"
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    times = [_timed(run, str(cache.device)) for _ in range(warmup + iters)][warmup:]
    for r in ids:
        cache.rollback(r, k + 1)
    return statistics.median(times)


def time_core(model, cache, ids, k: int, sparse: bool, warmup: int, iters: int) -> float:
    """Median seconds of the attention core alone (what reads the keys; projections left out): dense, the
    paged MLA over every key; sparse, index scores over every index key, top-k, MLA over the picks."""
    from kernels import dispatch
    from kernels.dsa import quantize_pow2, topk_indices
    from kernels.dispatch import paged_attention
    cfg, dev = model.cfg, cache.device
    attn = model.model.layers[0].self_attn
    batch = cache.prepare(ids, [k + 1] * len(ids))
    batch.attention_backend = "triton" if dev.type == "cuda" else "reference"
    N, h, g = batch.num_tokens, attn.heads, torch.Generator(device=dev).manual_seed(0)
    q_lat = torch.randn(N, h, cfg.kv_lora_rank, generator=g, device=dev).to(cache.ckv.dtype)
    q_pe = torch.randn(N, h, cfg.qk_rope_head_dim, generator=g, device=dev).to(cache.ckv.dtype)
    q = torch.randn(N, cfg.index_n_heads, cfg.index_head_dim, generator=g, device=dev)
    w = torch.rand(N, cfg.index_n_heads, generator=g, device=dev)
    q, q_scale = quantize_pow2(q) if cache.index_scale is not None else (q.to(cache.index_k.dtype), 1.0)
    w, width, kv = w * q_scale, batch.block_tables.shape[1] * batch.block_size, cache.layer(0)

    def run():
        if not sparse:
            return paged_attention(q_lat, q_pe, batch, kv.ckv, kv.kpe, attn.scale)
        scores = dispatch.index_scores(q, w, kv.index_k, kv.index_scale, batch.block_tables, batch.token_request,
                                       batch.positions, batch.context_lens, width)
        return dispatch.sparse_mla(q_lat, q_pe, kv.ckv, kv.kpe, batch.block_tables, batch.token_request,
                                   topk_indices(scores, cfg.index_topk), attn.scale, batch.attention_backend)
    if dev.type == "cuda":
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    times = [_timed(run, str(dev)) for _ in range(warmup + iters)][warmup:]
    for r in ids:
        cache.rollback(r, k + 1)
    return statistics.median(times)


def core_floor_bytes(cfg, cache, context: int, k: int, sparse: bool) -> int:
    """Bytes one request's attention core must read in one layer (see the module docstring)."""
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cache.ckv.element_size()
    if not sparse:
        return context * latent
    index = cfg.index_head_dim * cache.index_k.element_size() + (4 if cache.index_scale is not None else 0)
    return context * index + min(context, (k + 1) * cfg.index_topk) * latent


@torch.inference_mode()
def measure(model, a, context: int, batch: int, bw: float) -> list[dict]:
    from models import cuda_graphs
    from models.indexer import set_sparse
    from models.kv_cache import index_scoring_for
    from models.runner import new_cache
    rows = []
    blocks = batch * (-(-(context + a.k + 1) // 16) + 1) + 8
    for sparse in (True, False):
        set_sparse(model, sparse)
        cache = new_cache(model, blocks, 16, index_scoring_for(a.index_scoring, a.device))
        fwd = model
        if a.device.startswith("cuda") and not a.enforce_eager:
            fwd = cuda_graphs.GraphedForward(model, cache, model.cfg.hidden_size, cache.ckv.dtype,
                                             max_model_len=context + a.k + 16, max_tokens=max(16, batch * (a.k + 1)))
        ids = fill_requests(cache, batch, context, seed=context + batch)
        step = time_steps(model, cache, fwd, ids, a.k, a.warmup, a.iters, seed=batch)
        attn = time_attention(model, cache, ids, a.k, a.warmup, a.iters)
        core = time_core(model, cache, ids, a.k, sparse, a.warmup, a.iters)
        floor = batch * core_floor_bytes(model.cfg, cache, context, a.k, sparse) / bw
        rows.append({"context": context, "batch": batch, "k": a.k, "attention": "sparse" if sparse else "dense",
                     "scoring": cache.index_scoring if sparse else "-", "step_ms": 1000 * step,
                     "attn_layer_ms": 1000 * attn, "core_ms": 1000 * core, "core_floor_ms": 1000 * floor,
                     "core_vs_floor": core / floor})
        del fwd, cache
        torch.cuda.empty_cache() if a.device.startswith("cuda") else None
    set_sparse(model, True)
    sp, de = rows
    for key in ("step_ms", "attn_layer_ms", "core_ms"):
        sp[key.replace("_ms", "_vs_dense")] = sp[key] / de[key]
    return rows


def table(rows: list[dict], preset: str, bw: float) -> str:
    lines = [f"`{preset}`, copy bandwidth {bw / 1e12:.2f} TB/s. Step: verify forward + LM head, all layers. Layer: "
             "layer 0's attention with its projections (and the indexer when sparse). Core: what reads the keys "
             "(dense: paged MLA; sparse: index scores, top-k, sparse MLA), against its byte floor. CUDA graphs "
             "on a GPU.", "",
             "| context | batch | attention | step ms | sparse/dense | layer ms | sparse/dense | core ms | "
             "sparse/dense | core floor ms | core / floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = lambda key: f"**{r[key]:.2f}**" if key in r else ""
        mode = f"sparse ({r['scoring']})" if r["attention"] == "sparse" else "dense"
        lines.append(f"| {r['context']} | {r['batch']} | {mode} | {r['step_ms']:.2f} | {ratio('step_vs_dense')} | "
                     f"{r['attn_layer_ms']:.3f} | {ratio('attn_layer_vs_dense')} | {r['core_ms']:.3f} | "
                     f"{ratio('core_vs_dense')} | {r['core_floor_ms']:.3f} | {r['core_vs_floor']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from models.model import TargetModel
    from models.presets import load_any, preset_config, random_model_id
    from services.config import DTYPES
    p = argparse.ArgumentParser(prog="tandem bench dsa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random-config", default="v32-slice", help="a V3.2 preset of models/presets.py")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--contexts", default="8192,32768", help="cached positions per request")
    p.add_argument("--batches", default="1,8")
    p.add_argument("-k", type=int, default=NUM_SPECULATIVE_TOKENS, help="draft tokens per verify (K + 1 rows per request)")
    p.add_argument("--index-scoring", default="auto", choices=["auto", "exact", "deployed"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--enforce-eager", action="store_true", help="cuda: time eager steps, not CUDA graphs")
    p.add_argument("--out", default="results/dsa", help="writes OUT.md, OUT.json")
    a = p.parse_args(argv)
    if not preset_config(a.random_config).sparse_attention:
        p.error(f"--random-config {a.random_config} has no indexer (not a V3.2 model)")
    a.device = "cuda:0" if a.device == "cuda" else a.device
    dtype = DTYPES[a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")]
    model = load_any(TargetModel, random_model_id(a.random_config, a.seed), dtype=dtype, device=a.device)
    bw = copy_bandwidth(a.device, (2048 if a.device.startswith("cuda") else 64) << 20)
    rows = []
    for context in (int(x) for x in a.contexts.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            rows += measure(model, a, context, batch, bw)
            print("\n".join(table(rows[-2:], a.random_config, bw).splitlines()[-2:]), flush=True)
    md = table(rows, a.random_config, bw)
    write_results(a.out, "dsa", md, {"preset": a.random_config, "device": a.device, "bandwidth": bw, "rows": rows})
    return 0
