# MoE decode tiles with the shared experts inside (session 17): V2-Lite experts (2048 x 1408, 64 + 2 shared chunks,
# top-6), bf16, 1 / 4 / 32 tokens. Gate/up tiles swept with the shipped down tiles, then down tiles with the best
# gate/up. Time: CUDA-graph replay over 8 routings (different experts each call).
import itertools
import json
import sys

import torch

from kernels import moe_tiles
from kernels.triton_moe import fused_moe_triton

dev, D, I, E, k, c = "cuda", 2048, 1408, 64, 6, 2
g = torch.Generator(device=dev).manual_seed(0)
w13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
sw13 = torch.randn(2 * c * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
sw2 = torch.randn(D, c * I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02


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


rows = []
for N in (1, 4, 32):
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
    ids = [torch.rand(N, E, device=dev, generator=g).argsort(1)[:, :k].contiguous() for _ in range(8)]
    rw = torch.rand(N, k, device=dev, generator=g)
    shipped = moe_tiles.moe_tiles("bf16", N, N * (k + c), D, I)
    ref = fused_moe_triton(x, w13, w2, rw, ids[0], 0, shared=(sw13, sw2))

    def cost(tiles):
        try:
            out = fused_moe_triton(x, w13, w2, rw, ids[0], 0, tiles=tiles, shared=(sw13, sw2))
            same = torch.equal(out, ref)
            return timed(lambda i: fused_moe_triton(x, w13, w2, rw, ids[i], 0, tiles=tiles, shared=(sw13, sw2))), same
        except Exception as e:  # noqa: BLE001
            return float("nan"), str(e)[:60]
    base, _ = cost(shipped)
    gu_cands = [(bn, bk, w, s, 1) for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 4, 5))]
    best_gu = (base, shipped[0])
    for t in gu_cands:
        us, same = cost((t, shipped[1]))
        rows.append(dict(N=N, part="gate_up", tiles=t, us=us, same=same))
        if us == us and us < best_gu[0]:
            best_gu = (us, t)
    dn_cands = [(bn, bk, w, s, 1) for bn, bk, w, s in itertools.product((32, 64, 128), (64, 128, 256), (2, 4), (3, 4, 5))]
    best_dn = (best_gu[0], shipped[1])
    for t in dn_cands:
        us, same = cost((best_gu[1], t))
        rows.append(dict(N=N, part="down", tiles=t, us=us, same=same))
        if us == us and us < best_dn[0]:
            best_dn = (us, t)
    floor = (min(N * k, E) + c) * 3 * D * I * 2 / 4.23e12 * 1e6      # ~ experts read (upper bound on distinct)
    print(f"N={N}: shipped {shipped} {base:.1f} us; best gate/up {best_gu[1]} {best_gu[0]:.1f}; best down {best_dn[1]} "
          f"{best_dn[0]:.1f} us; floor <= {floor:.1f} us", flush=True)
json.dump(rows, open(sys.argv[1], "w"))
