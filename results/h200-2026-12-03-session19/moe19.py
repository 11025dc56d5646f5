# fp8 fused MoE at decode sizes (session 19): V2-Lite experts (2048 x 1408, 64 routed + 2 shared chunks, top-6),
# per-kernel times of the shipped tiles (torch.profiler), then a gate/up and down tile sweep at 1 and 4 tokens with
# a time budget. Time: CUDA-graph replay over 8 routings (different experts each call); bits checked vs shipped.
import itertools
import json
import sys
import time

import torch

from kernels import moe_tiles
from kernels.fp8 import quantize_weight
from kernels.triton_fp8_moe import fused_moe_fp8_triton
from kernels.triton_moe import fused_moe_triton

dev, D, I, E, k, c = "cuda", 2048, 1408, 64, 6, 2
g = torch.Generator(device=dev).manual_seed(0)
b13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
b2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
bs13 = torch.randn(2 * c * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
bs2 = torch.randn(D, c * I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
q = [quantize_weight(b13[e]) for e in range(E)]
w13, s13 = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
q = [quantize_weight(b2[e]) for e in range(E)]
w2, s2 = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
shared = quantize_weight(bs13) + quantize_weight(bs2)


def timed(fn, reps=8):
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


rows, t0, budget = [], time.time(), float(sys.argv[2]) if len(sys.argv) > 2 else 150
for N in (1, 4):
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
    ids = [torch.rand(N, E, device=dev, generator=g).argsort(1)[:, :k].contiguous() for _ in range(8)]
    rw = torch.rand(N, k, device=dev, generator=g)
    shipped = moe_tiles.moe_tiles("fp8", N, N * (k + c), D, I)
    run = lambda i, tiles=None: fused_moe_fp8_triton(x, w13, s13, w2, s2, rw, ids[i], 0, tiles=tiles, shared=shared)
    ref = run(0)
    bf = timed(lambda i: fused_moe_triton(x, b13, b2, rw, ids[i], 0, shared=(bs13, bs2)))
    base = timed(run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for i in range(8):
            run(i)
        torch.cuda.synchronize()
    per = {e.key: round(e.self_device_time_total / e.count, 2) for e in p.key_averages() if e.self_device_time_total}
    print(f"N={N}: bf16 {bf:.1f} us, fp8 shipped {shipped} {base:.1f} us; kernels us {per}", flush=True)
    rows.append(dict(N=N, part="shipped", tiles=shipped, us=base, bf16=bf, kernels=per))

    def cost(tiles):
        try:
            same = torch.equal(run(0, tiles), ref)
            return timed(lambda i: run(i, tiles)), same
        except Exception as e:  # noqa: BLE001
            return float("nan"), str(e)[:60]
    best_gu = (base, shipped[0])
    for t in [(bn, 128, w, s, 1) for bn, w, s in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 3, 4, 6, 8))]:
        if time.time() - t0 > budget * (0.3 if N == 1 else 0.85):
            break
        us, same = cost((t, shipped[1]))
        rows.append(dict(N=N, part="gate_up", tiles=t, us=us, same=same))
        if us == us and us < best_gu[0]:
            best_gu = (us, t)
    best_dn = (best_gu[0], shipped[1])
    for t in [(bn, 128, w, s, 1) for bn, w, s in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 3, 4, 6))]:
        if time.time() - t0 > budget * (0.5 if N == 1 else 1.0):
            break
        us, same = cost((best_gu[1], t))
        rows.append(dict(N=N, part="down", tiles=t, us=us, same=same))
        if us == us and us < best_dn[0]:
            best_dn = (us, t)
    floor = (min(N * k, E) + c) * 3 * D * I / 4.23e12 * 1e6
    print(f"N={N}: best gate/up {best_gu[1]} {best_gu[0]:.1f}; best down {best_dn[1]} {best_dn[0]:.1f} us; "
          f"fp8 floor <= {floor:.1f} us ({time.time() - t0:.0f} s)", flush=True)
    json.dump(rows, open(sys.argv[1], "w"))
