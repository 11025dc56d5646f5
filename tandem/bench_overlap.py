"""`tandem bench overlap`: how often deployed (fp8) index scoring picks the keys exact (fp32) scoring picks.

Random inputs as DeepSeek-V3.2's indexer sees them: one request of `--context` tokens, i.i.d. Gaussian
index keys, queries ([heads, dim] per token) and head weights; every query t selects its top
min(index_topk, t + 1) keys among positions 0..t, once with exact scores and once with deployed ones
(Hadamard rotation, fp8 e4m3 with power-of-two scales: kernels/dsa.py). Queries t < index_topk select
every key they see, so both modes agree there by construction; the figures are over the queries that do
select (t >= index_topk): the mean overlap |exact & deployed| / index_topk, the worst query, the last one
(the hardest: at 4096 tokens it keeps half its keys, cutting where scores are densest), and how close to
the exact cut every disagreement lies, in standard deviations of that query's exact scores (near-ties).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels import dsa


def selection_overlap(context: int = 4096, topk: int = 2048, heads: int = 64, dim: int = 128, seed: int = 0,
                      stride: int = 1, device: str = "cpu", chunk: int = 64) -> dict:
    """Overlap of the two modes' selections over queries topk, topk + stride, .. context - 1."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(context, dim, generator=g)                              # [T, D]
    q = torch.randn(context, heads, dim, generator=g)                       # [T, H, D]
    w = torch.randn(context, heads, generator=g) * heads ** -0.5 * dim ** -0.5
    k, q, w = k.to(device), q.to(device), w.to(device)
    (qq, qs), (kq, ks) = dsa.quantize_pow2(dsa.rotate(q)), dsa.quantize_pow2(dsa.rotate(k))
    bs = 64 if context % 64 == 0 else 1
    tables = torch.arange(context // bs, dtype=torch.int32, device=device)[None]
    ctx = torch.tensor([context], dtype=torch.int32, device=device)
    picks = torch.arange(topk, context, stride, device=device)
    overlaps, gaps = [], []
    for rows in picks.split(chunk):
        req = torch.zeros(len(rows), dtype=torch.int32, device=device)
        exact = dsa.index_scores(q[rows], w[rows], k.view(-1, bs, dim), None, tables, req, rows, ctx, context)
        dep = dsa.index_scores(qq[rows], w[rows] * qs[rows], kq.view(-1, bs, dim), ks.view(-1, bs), tables, req,
                               rows, ctx, context)
        e, d = dsa.topk_indices(exact, topk), dsa.topk_indices(dep, topk)
        for n, t in enumerate(rows.tolist()):
            a, b = set(e[n].tolist()), set(d[n].tolist())
            overlaps.append(len(a & b) / topk)
            seen = exact[n, : t + 1]
            cut, spread = seen.topk(topk).values[-1], seen.std()
            gaps.append(max((abs(exact[n, j] - cut).item() for j in a ^ b), default=0.0) / spread.item())
    return {"context": context, "topk": topk, "heads": heads, "dim": dim, "seed": seed, "queries": len(overlaps),
            "mean": sum(overlaps) / len(overlaps), "min": min(overlaps), "last": overlaps[-1],
            "max_gap_std": max(gaps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,8192", help="tokens of the random request")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--topk", type=int, default=2048, help="index_topk (DeepSeek-V3.2: 2048)")
    p.add_argument("--stride", type=int, default=1, help="measure every stride-th selecting query")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="results/overlap.json")
    a = p.parse_args(argv)
    rows = []
    print("| context | seed | queries | mean overlap | worst query | last query | disagreements within (std of the cut) |")
    print("|---|---|---|---|---|---|---|")
    for context in (int(x) for x in a.contexts.split(",")):
        for seed in (int(x) for x in a.seeds.split(",")):
            r = selection_overlap(context, a.topk, seed=seed, stride=a.stride, device=a.device)
            rows.append(r)
            print(f"| {context} | {seed} | {r['queries']} | {r['mean']:.4f} | {r['min']:.4f} | {r['last']:.4f} | "
                  f"{r['max_gap_std']:.3f} |", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0
