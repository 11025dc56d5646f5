"""Block-scaled fp8 GEMM in Triton for decode-sized M: y [M, N] = x [M, K] @ w [N, K]^T, DeepSeek's scheme
(kernels/fp8.py: fp8 e4m3 weights with a fp32 scale per 128x128 block, activations quantized per token per
128 columns), the activations quantized inside the kernel (no extra launch, no fp8 copy of x in memory).

Decode reads every weight byte once for a handful of tokens, so the kernel is laid out for bandwidth:
  * swapped operands: each program computes out^T tile [BLOCK_N, BLOCK_M] = w tile [BLOCK_N, 128] @
    x_q^T [128, BLOCK_M], so the weight rows fill the tensor cores' large dimension and 1..16 tokens the
    small one;
  * split-K: programs (N / BLOCK_N) x SPLIT_K x (M / BLOCK_M); SPLIT_K is chosen from (N, K) alone so that
    even N = 576 spreads over every SM. Split partials go to an fp32 workspace [SPLIT_K, M, N] and one small
    kernel sums them in a fixed order (deterministic: no atomics);
  * each 128-wide K block is one fp8 dot promoted to fp32 with its two scales (the DeepSeek-V3 report's
    promotion interval), acc += dot * a_s[m] * w_s[n].
Config (BLOCK_M, SPLIT_K) depends on (N, K) and on M only through BLOCK_M = 16 up to 16 rows, 32 up to 32, 64
beyond: a row's result does not depend on how many other rows share its step within one BLOCK_M class.
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision

BLOCK_K = 128                      # = the scale block: one activation scale and one weight scale per K tile
FP8_MAX = 448.0
AMAX_MIN = 1e-12
TARGET_PROGRAMS = 264              # two waves of an H200's 132 SMs


@triton.jit
def quant_rows(a, EXACT: tl.constexpr):
    # a [R, 128] fp32 -> (fp8 e4m3 [R, 128], scales [R] fp32): amax of each row -> 448 (kernels/fp8.quantize_act)
    s = tl.maximum(tl.max(tl.abs(a), 1), 1e-12) / 448.0
    v = tl.math.div_rn(a, s[:, None])
    if EXACT:    # the interpreter's fp32 -> e4m3 cast misrounds at binade edges (127.9 -> 64): round here
        ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)   # e4m3: 3 mantissa bits
        v = ((v / ulp + 12582912.0) - 12582912.0) * ulp                            # half to even (1.5 * 2^23)
    return v.to(tl.float8e4nv), s


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, KT, s_xm, s_wn, s_sn, s_om, s_os,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TILES: tl.constexpr, PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                    # output features
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)                    # tokens
    cm, rm = cols < N, rows < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)                                # out^T tile
    for t in range(TILES):
        kb = split * TILES + t
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K                                                                # also false past the last tile
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + k[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0).to(tl.float32)                                     # [BM, BK]
        aq, a_s = quant_rows(a, PRECISION == "upcast")
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_wn + k[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0)                                                    # [BN, BK] fp8
        w_s = tl.load(s_ptr + (cols // BLOCK_K) * s_sn + tl.minimum(kb, KT - 1), mask=cm, other=0.0)   # [BN]
        acc += dot(w, tl.trans(aq), PRECISION) * w_s[:, None] * a_s[None, :]
    o = out_ptr + split * s_os + rows[None, :].to(tl.int64) * s_om + cols[:, None]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=cm[:, None] & rm[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, MN, s_ws, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = sum_s ws[s, i] in split order, cast to out's dtype
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws_ptr + s * s_ws + i, mask=m, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


def block_m_for(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def config(N: int, K: int, block_n: int = 64) -> tuple[int, int]:
    """(SPLIT_K, K tiles per split) from the weight's shape alone: enough programs to cover the GPU."""
    kt = triton.cdiv(K, BLOCK_K)
    split = max(1, min(kt, TARGET_PROGRAMS // triton.cdiv(N, block_n)))
    tiles = triton.cdiv(kt, split)
    return triton.cdiv(kt, tiles), tiles                                          # no empty split


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), w [N, K] fp8 e4m3, s [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in x's dtype,
    as kernels.fp8.fp8_linear. split_k forces the split (tests)."""
    shape, K = x.shape, x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    assert w.shape == (N, K) and w.stride(1) == 1 and s.stride(1) == 1, (tuple(w.shape), tuple(s.shape))
    assert s.shape == (triton.cdiv(N, BLOCK_K), triton.cdiv(K, BLOCK_K)), (tuple(s.shape), N, K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(*shape[:-1], N)
    bm, bn, kt = block_m_for(M), 64, triton.cdiv(K, BLOCK_K)
    split, tiles = config(N, K, bn)
    if split_k is not None:
        tiles = triton.cdiv(kt, split_k)
        split = triton.cdiv(kt, tiles)
    ws = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, bn), split, triton.cdiv(M, bm))
    _gemm_kernel[grid](x2, w, s, ws, M, N, K, kt, x2.stride(0), w.stride(0), s.stride(0), N, M * N,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, TILES=tiles,
                       PRECISION=dot_precision(w), num_warps=4, num_stages=4)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](ws, out, M * N, M * N, SPLIT_K=split, BLOCK=block)
    return out.view(*shape[:-1], N)
