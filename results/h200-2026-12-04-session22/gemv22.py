# Session 22: a bf16 Triton GEMM for decode rows (swap form: weight rows on the MMA's long side) against cuBLAS as
# dense_linear runs it (128 padded rows) and cuBLAS at M rows, V2-Lite's projections; CUDA graph of 20 calls over
# rotated weights (bench_fp8.device_time), PDL on for the Triton kernel. Row bits across M checked.
import torch, triton, triton.language as tl
import torch.nn.functional as F
from tandem.bench_fp8 import device_time, rotating, cycle, FLOOR_BW
from kernels.pdl import wait_prior

@triton.jit
def _k(x_ptr, w_ptr, o_ptr, M, N, K, TPS, s_xm, s_wn, s_om, s_os, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       PDL: tl.constexpr):
    wait_prior(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    sp = tl.program_id(2)
    rm, cm = rows < M, cols < N
    acc = tl.zeros([BN, BM], tl.float32)
    k0 = sp * TPS
    for kk in range(k0, tl.minimum(k0 + TPS, K), BK):
        k = kk + tl.arange(0, BK)
        km = k < K
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_wn + k[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(w, tl.trans(x))
    tl.store(o_ptr + sp.to(tl.int64) * s_os + rows[None, :] * s_om + cols[:, None], acc.to(o_ptr.dtype.element_ty),
             mask=cm[:, None] & rm[None, :])

@triton.jit
def _sum(ws_ptr, out_ptr, MN, SPLIT, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    off = i.to(tl.int64)
    for _ in range(SPLIT):
        acc += tl.load(ws_ptr + off, mask=m, other=0.0)
        off += MN
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)

def tgemm(x, w, BM, BN, BK, split, warps, stages):
    M, K = x.shape; N = w.shape[0]
    tps = triton.cdiv(triton.cdiv(K, BK), split) * BK
    split = triton.cdiv(K, tps)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _k[(triton.cdiv(M, BM), triton.cdiv(N, BN), split)](x, w, ws, M, N, K, tps, x.stride(0), w.stride(0), N, M * N,
        BM=BM, BN=BN, BK=BK, PDL=True, num_warps=warps, num_stages=stages, launch_pdl=True)
    if split > 1:
        _sum[(triton.cdiv(M * N, 1024),)](ws, out, M * N, split, BLOCK=1024, PDL=True, launch_pdl=True)
    return out

shapes = [("q|kv_a", 3648, 2048), ("o_proj", 2048, 2048), ("dense gate|up", 10944, 2048), ("dense down", 2048, 10944)]
cfgs = [(16, 32, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 64, 128, 1, 4, 4), (16, 64, 128, 2, 4, 4),
        (16, 16, 256, 1, 4, 4), (16, 32, 128, 2, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 4, 4, 4),
        (16, 64, 128, 4, 4, 4), (16, 32, 512, 1, 4, 2), (16, 128, 128, 1, 4, 4), (16, 128, 128, 2, 8, 3)]
bm = lambda M: 16 if M <= 16 else 32 if M <= 32 else 64
g = torch.Generator(device="cuda").manual_seed(0)
for name, N, K in shapes:
    floor = N * K * 2 / FLOOR_BW * 1e6
    ws = rotating(lambda: torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02, N * K * 2, "cuda")
    x128 = torch.randn(128, K, device="cuda", generator=g).bfloat16()
    line = [f"{name} N={N} K={K} floor {floor:.2f} us"]
    cub = device_time(cycle(lambda w: F.linear(x128, w), ws), "cuda")
    line.append(f"cuBLAS 128 rows (served) {cub*1e6:.2f}")
    for M in (1, 4):
        t = device_time(cycle(lambda w: F.linear(x128[:M], w), ws), "cuda")
        line.append(f"cuBLAS {M} rows {t*1e6:.2f}")
    print(" | ".join(line), flush=True)
    ref = F.linear(x128.float(), ws[0].float())
    for c in cfgs:
        BM, BN, BK, split, warps, stages = c
        res = []
        try:
            for M in (1, 4, 32, 128):
                cm = (bm(M),) + c[1:]
                t = device_time(cycle(lambda w: tgemm(x128[:M], w, *cm), ws), "cuda")
                res.append(f"M{M} {t*1e6:.2f}")
            same = all(torch.equal(tgemm(x128[:M], ws[0], bm(M), *c[1:])[0], tgemm(x128[:1], ws[0], *c)[0])
                       for M in (4, 32, 128))
            err = (tgemm(x128, ws[0], *c).float() - ref).abs().max().item()
            print(f"  triton BM{BM} BN{BN} BK{BK} split{split} w{warps} s{stages}: {' '.join(res)} row bits same across M: {same} maxerr {err:.3g}", flush=True)
        except Exception as e:
            print(f"  triton {c}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
