# Programmatic dependent launch (PDL) in a CUDA graph (session 21): a chain of dependent weight-streaming GEMVs
# (y = W x, x = the previous kernel's y), the same body launched plain or with launch_pdl under four placements of
# gdc_wait / gdc_launch_dependents. us per kernel = graph replay / chain length, against the byte floor.
import sys, time
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents


@triton.jit
def gemv(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
         EARLY: tl.constexpr, TRIGGER: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    if TRIGGER:
        gdc_launch_dependents()
    if PDL and not EARLY:
        gdc_wait()
    acc = tl.zeros([BN], tl.float32)
    w0 = tl.load(w_ptr + rows[:, None] * K + tl.arange(0, BK)[None, :])            # first tile before the wait
    if PDL and EARLY:
        gdc_wait()
    x0 = tl.load(x_ptr + tl.arange(0, BK)).to(tl.float32)
    acc += tl.sum(w0.to(tl.float32) * x0[None, :], 1)
    for k0 in range(BK, K, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        x = tl.load(x_ptr + k).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty) * 0.01)


def chain(N, K, variant, length=60, BN=16, BK=256):
    pdl, early, trigger = variant
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    xs = [torch.randn(max(N, K), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    def body():
        for i in range(length):
            gemv[(N // BN,)](ws[i % 4], xs[i % 2], xs[(i + 1) % 2], N, K=K, BN=BN, BK=BK, PDL=pdl, EARLY=early,
                             TRIGGER=trigger, num_warps=4, launch_pdl=pdl)
    body(); torch.cuda.synchronize()
    ref = xs[0].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    best = 1e9
    for _ in range(7):
        xs[0].normal_(); xs[1].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / length)
    # correctness: eager plain chain vs graph chain from the same start
    start = torch.randn(max(N, K), device="cuda", dtype=torch.bfloat16)
    xs[0].copy_(start); g.replay(); torch.cuda.synchronize(); got = xs[0].clone()
    xs[0].copy_(start)
    for i in range(length):
        gemv[(N // BN,)](ws[i % 4], xs[i % 2], xs[(i + 1) % 2], N, K=K, BN=BN, BK=BK, PDL=False, EARLY=False,
                         TRIGGER=False, num_warps=4)
    torch.cuda.synchronize()
    return best, torch.equal(got, xs[0])


VARIANTS = {"plain": (False, False, False), "pdl wait first": (True, False, False),
            "pdl wait after 1st tile": (True, True, False), "pdl trigger + wait first": (True, False, True),
            "pdl trigger + wait after 1st tile": (True, True, True)}
for N, K in ((2048, 2048), (3072, 2048), (4096, 2048), (2816, 2048)):
    floor = N * K * 2 / 4.23e12 * 1e6
    for name, v in VARIANTS.items():
        try:
            us, ok = chain(N, K, v)
            print(f"W {N}x{K} ({N*K*2/2**20:.0f} MiB, floor {floor:.2f} us): {name:34s} {us:6.2f} us/kernel  same bits {ok}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"W {N}x{K}: {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
