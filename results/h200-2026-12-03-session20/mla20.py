# MLA decode attention tile sweep (session 20): kernels/triton_mla.py at V2-Lite (16 heads) and V3 (128 heads),
# R = 512, P = 64, block size 16, table width 256 blocks (4096 keys). Per (heads, rows, context): each config's
# time per call in a CUDA graph of 4 calls over 4 rotated page sets; the default rule first (two launches, and
# merged inside with counters). Prints JSON lines; bits checked: merged == two launches, configs vs default rel.
import itertools
import json
import sys
import time

import torch

from kernels.triton_mla import mla_attention_triton

dev, R, P, BS, WIDTH = "cuda", 512, 64, 16, 256
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 240
t_start = time.time()


def case(H, N, L, sets=4):
    rows = 4 if N >= 4 else 1
    B = N // rows
    pages = sets * B * (L // BS)
    g = torch.Generator(device=dev).manual_seed(0)
    ckv = torch.randn(pages + 1, BS, R, device=dev, dtype=torch.bfloat16, generator=g)
    kpe = torch.randn(pages + 1, BS, P, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(pages, device=dev, generator=g).int() + 1
    tables = []
    for s in range(sets):
        t = torch.zeros(B, WIDTH, dtype=torch.int32, device=dev)
        t[:, :L // BS] = perm[s * B * (L // BS):(s + 1) * B * (L // BS)].view(B, -1)
        tables.append(t)
    req = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(rows)
    pos = (L - rows + torch.arange(rows, device=dev)).repeat(B).long()
    clen = torch.full((B,), L, dtype=torch.int32, device=dev)
    ql = torch.randn(N, H, R, device=dev, dtype=torch.bfloat16, generator=g)
    qp = torch.randn(N, H, P, device=dev, dtype=torch.bfloat16, generator=g)
    return ckv, kpe, tables, req, pos, clen, ql, qp


def timed(fn, calls=4, reps=10):
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    ts.sort()
    return ts[len(ts) // 2]


configs = [dict(block_n=bn, splits=sp, num_warps=w) for bn, sp, w in
           ((64, None, 8), (64, 8, 8))]
arr = torch.zeros(1 << 15, dtype=torch.int32, device=dev)
for H, N, L in itertools.product((16, 128), (1, 4, 32, 128), (64, 256, 1024, 4096)):
    if time.time() - t_start > budget:
        print(json.dumps({"stopped": "budget", "at": [H, N, L]}), flush=True)
        break
    ckv, kpe, tables, req, pos, clen, ql, qp = case(H, N, L)
    out = torch.empty(N, H, R, device=dev, dtype=torch.bfloat16)

    def call(cfg, merge):
        return lambda i: mla_attention_triton(ql, qp, ckv, kpe, tables[i], req, pos, clen, 0.1, out=out,
                                              arrivals=arr if merge else None, **cfg)
    ref = mla_attention_triton(ql, qp, ckv, kpe, tables[0], req, pos, clen, 0.1).float()
    rows = []
    for cfg, merge in [(configs[0], False)] + [(c, True) for c in configs]:
        if time.time() - t_start > budget:
            break
        try:
            us = timed(call(cfg, merge))
            got = mla_attention_triton(ql, qp, ckv, kpe, tables[0], req, pos, clen, 0.1,
                                       arrivals=arr if merge else None, **cfg).float()
            rel = float((got - ref).abs().max() / ref.abs().max())
            rows.append({**{k: v for k, v in cfg.items()}, "merge": merge, "us": round(us, 2), "rel": rel,
                         "counters_zero": bool((arr == 0).all())})
        except Exception as e:  # a config that does not compile
            rows.append({**cfg, "merge": merge, "error": repr(e)[:200]})
    best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(json.dumps({"H": H, "N": N, "L": L, "default_two_launches": rows[0], "default_merged": rows[1],
                      "best": best, "all": rows}), flush=True)
