# bf16 fused MoE at decode sizes with the shared experts inside (session 21): V2-Lite experts (2048 x 1408, 64 routed
# + 2 shared chunks, top-6). The bf16 DECODE tiles were swept on 2026-12-01 with 6 pairs a token (shared experts
# outside); inside, a token has 8. Per N: shipped tiles' per-kernel times, then a gate/up and a down sweep under a
# time budget. Time: CUDA-graph replay over 8 routings; bits checked against the shipped tiles.
import itertools, json, sys, time
import torch
from kernels import moe_tiles
from kernels.triton_moe import fused_moe_triton

dev, D, I, E, k, c = "cuda", 2048, 1408, 64, 6, 2
g = torch.Generator(device=dev).manual_seed(0)
w13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
s13 = torch.randn(2 * c * I, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
s2 = torch.randn(D, c * I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02


def timed(fn, reps=8):
    fn(0); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


rows, t0, budget = [], time.time(), float(sys.argv[2])
Ns = [int(n) for n in sys.argv[3].split(",")]
for j, N in enumerate(Ns):
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
    ids = [torch.rand(N, E, device=dev, generator=g).argsort(1)[:, :k].contiguous() for _ in range(8)]
    rw = torch.rand(N, k, device=dev, generator=g)
    shipped = moe_tiles.moe_tiles("bf16", N, N * (k + c), D, I)
    run = lambda i, tiles=None: fused_moe_triton(x, w13, w2, rw, ids[i], 0, tiles=tiles, shared=(s13, s2))
    ref = run(0)
    base = timed(run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for i in range(8):
            run(i)
        torch.cuda.synchronize()
    per = {e.key: round(e.self_device_time_total / e.count, 2) for e in p.key_averages() if e.self_device_time_total}
    experts = min(N * k, E) + c
    floor = experts * 3 * D * I * 2 / 4.23e12 * 1e6
    print(f"N={N}: shipped {shipped} {base:.1f} us (bf16 floor <= {floor:.1f}); kernels us {per}", flush=True)
    rows.append(dict(N=N, part="shipped", tiles=shipped, us=base, kernels=per, floor=floor))

    def cost(tiles):
        try:
            same = torch.equal(run(0, tiles), ref)
            return timed(lambda i: run(i, tiles)), same
        except Exception as e:  # noqa: BLE001
            return float("nan"), str(e)[:80]
    end_gu = t0 + budget * (j + 0.6) / len(Ns)
    end_dn = t0 + budget * (j + 1) / len(Ns)
    best_gu = (base, shipped[0])
    for t in [(bn, bk, w, s, 1) for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (3, 4, 6, 8))]:
        if time.time() > end_gu:
            break
        us, same = cost((t, shipped[1]))
        rows.append(dict(N=N, part="gate_up", tiles=t, us=us, same=same))
        if us == us and us < best_gu[0] and same is True:
            best_gu = (us, t)
    best_dn = (best_gu[0], shipped[1])
    for t in [(bn, bk, w, s, 1) for bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (3, 4, 6))]:
        if time.time() > end_dn:
            break
        us, same = cost((best_gu[1], t))
        rows.append(dict(N=N, part="down", tiles=t, us=us, same=same))
        if us == us and us < best_dn[0] and same is True:
            best_dn = (us, t)
    print(f"N={N}: best gate/up {best_gu[1]} {best_gu[0]:.1f}; best down {best_dn[1]} {best_dn[0]:.1f} us "
          f"(shipped {base:.1f}, floor {floor:.1f}; {time.time() - t0:.0f} s)", flush=True)
    json.dump(rows, open(sys.argv[1], "w"))
