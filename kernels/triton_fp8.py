"""Block-scaled fp8 GEMM in Triton for decode-sized M: y [M, N] = x [M, K] @ w [N, K]^T, DeepSeek's scheme
(kernels/fp8.py: fp8 e4m3 weights with a fp32 scale per 128x128 block, activations quantized per token per
128 columns). Decode reads every weight byte once for a handful of tokens, so the GEMM is laid out to stream
weights: each program owns BLOCK_N output features, a K split and BLOCK_M rows, and walks its K tiles in a
software pipeline `stages` deep; each 128-wide K tile is one fp8 dot promoted to fp32 with its two scales (the
DeepSeek-V3 report's promotion interval), acc += dot * a_s[m] * w_s[n].

Per call, kernels/triton_fp8_config.py gives the Config (tile, split) for (N, K) and the row class of M:
  * `_quant_kernel` quantizes x once (x_q [M, K] fp8, scales [K/128, M] fp32), unless the tile is `fused`: then
    every program quantizes its own activation tiles (one launch less, the work repeated per N block);
  * `_gemm_kernel`, grid (M / BLOCK_M, N / BLOCK_N, split): `swap` computes out^T tile [BLOCK_N, BLOCK_M] = w tile
    @ x_q^T so that weight rows fill the MMA's long side and 1..16 tokens its short one; otherwise out tile =
    x_q @ w^T;
  * split > 1: partials go to an fp32 workspace [split, M, N] and `_sum_splits_kernel` adds them in split order
    (deterministic: no atomics);
  * a CUBLAS config runs torch._scaled_mm on the quantized x instead (prefill sizes where it is right).
A row's bits depend on the config's split and MMA kind only, and those not on M up to 128 rows (see the config
module).
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision
from kernels.triton_fp8_config import BLOCK_K, CUBLAS, SMS, Config, lookup

QUANT_GROUPS = 8                   # 128-column groups per _quant_kernel program
SUM_BLOCK = 1024
# counts that vary per call or shape: one compiled variant serves them all (M = 1 would be a constant otherwise)
VARYING = ["M", "KT", "TPS", "s_xs", "s_sn", "s_os"]


@triton.jit
def quant_rows(a, EXACT: tl.constexpr):
    # a [R, 128] fp32 -> (fp8 e4m3 [R, 128], scales [R] fp32): amax of each row -> 448 (kernels/fp8.quantize_act)
    s = tl.maximum(tl.max(tl.abs(a), 1), 1e-12) / 448.0
    v = tl.math.div_rn(a, s[:, None])
    if EXACT:    # the interpreter's fp32 -> e4m3 cast misrounds at binade edges (127.9 -> 64): round here
        ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)   # e4m3: 3 mantissa bits
        v = ((v / ulp + 12582912.0) - 12582912.0) * ulp                            # half to even (1.5 * 2^23)
    return v.to(tl.float8e4nv), s


@triton.jit(do_not_specialize=["M", "KT"])
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KT, s_xm, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr,
                  EXACT: tl.constexpr):
    # x [M, K] -> q [M, K] fp8, s [KT, M] fp32 (scales K-block-major: s.t() is cuBLAS's outer-dim-major [M, KT])
    m = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                        # [G] K blocks
    k = kb[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]                   # [G, BK]
    mask = (kb[:, None] < KT) & (k < K)
    a = tl.load(x_ptr + m * s_xm + k, mask=mask, other=0.0).to(tl.float32)
    q, s = quant_rows(a, EXACT)
    tl.store(q_ptr + m * K + k, q, mask=mask)
    tl.store(s_ptr + kb.to(tl.int64) * M + m, s, mask=kb < KT)


@triton.jit
def _scales(w_scales, xs_ptr, rows, rm, kbs, KT, s_xs, KSTEP: tl.constexpr, BLOCK_M: tl.constexpr,
            FUSED: tl.constexpr):
    # scales of K tiles kbs .. kbs + KSTEP - 1 -> (weight [KSTEP], activations [KSTEP, BM]; zeros if FUSED: those
    # come with the quantization); tiles past the split or K read a valid scale and multiply a zero tile
    kk = tl.minimum(kbs + tl.arange(0, KSTEP), KT - 1)
    w_s = tl.load(w_scales + kk)
    if FUSED:
        a_s = tl.zeros([KSTEP, BLOCK_M], tl.float32)
    else:
        a_s = tl.load(xs_ptr + kk[:, None].to(tl.int64) * s_xs + rows[None, :], mask=rm[None, :], other=0.0)
    return w_s, a_s


@triton.jit(do_not_specialize=VARYING)
def _gemm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, KT, TPS, s_xm, s_xs, s_wn, s_sn, s_om, s_os,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KSTEP: tl.constexpr,
                 FUSED: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    # BLOCK_N divides 128: one weight scale per K tile. The scales of a stage load one stage ahead (the pipeliner
    # stages only the dot's operands; a scale loaded where it is used would stall every step on its latency).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                    # tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                    # output features
    split = tl.program_id(2)
    rm, cm = rows < M, cols < N
    kb0 = split * TPS                                                              # this split's K tiles
    kb_end = tl.minimum(kb0 + TPS, KT)
    k_end = tl.minimum(K, kb_end * BLOCK_K)                                        # columns past it: zeros
    x_rows = x_ptr + rows[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * s_wn
    w_scales = s_ptr + (tl.program_id(1) * BLOCK_N // BLOCK_K).to(tl.int64) * s_sn
    jj = tl.arange(0, KSTEP)
    ws_next, as_next = _scales(w_scales, xs_ptr, rows, rm, kb0, KT, s_xs, KSTEP, BLOCK_M, FUSED)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)                             # out^T tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kbs in range(kb0, kb_end, KSTEP):                                          # KSTEP K tiles per stage
        ws_cur, as_cur = ws_next, as_next
        ws_next, as_next = _scales(w_scales, xs_ptr, rows, rm, kbs + KSTEP, KT, s_xs, KSTEP, BLOCK_M, FUSED)
        for j in tl.static_range(KSTEP):
            k = (kbs + j) * BLOCK_K + tl.arange(0, BLOCK_K)
            km = k < k_end
            w = tl.load(w_rows + k[None, :], mask=cm[:, None] & km[None, :], other=0.0)      # [BN, BK] fp8
            w_s = tl.sum(tl.where(jj == j, ws_cur, 0.0), 0)                                   # scalar
            xt = tl.load(x_rows + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)     # [BM, BK]
            if FUSED:
                aq, a_s = quant_rows(xt.to(tl.float32), PRECISION == "upcast")
            else:
                aq, a_s = xt, tl.sum(tl.where(jj[:, None] == j, as_cur, 0.0), 0)             # fp8, [BM]
            if SWAP:
                acc += dot(w, tl.trans(aq), PRECISION) * a_s[None, :] * w_s
            else:
                acc += dot(aq, tl.trans(w), PRECISION) * a_s[:, None] * w_s
    o = out_ptr + split.to(tl.int64) * s_os
    if SWAP:
        tl.store(o + rows[None, :].to(tl.int64) * s_om + cols[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=cm[:, None] & rm[None, :])
    else:
        tl.store(o + rows[:, None].to(tl.int64) * s_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["MN", "SPLIT"])
def _sum_splits_kernel(ws_ptr, out_ptr, MN, SPLIT, BLOCK: tl.constexpr):
    # out[i] = sum_s ws[s, i] in split order, cast to out's dtype; ws [SPLIT, MN] fp32
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    off = i.to(tl.int64)
    for _ in range(SPLIT):
        acc += tl.load(ws_ptr + off, mask=m, other=0.0)
        off += MN
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


@functools.cache
def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SMS


def quantize(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (row stride any, column stride 1) -> (x_q [M, K] fp8, scales [ceil(K/128), M] fp32)."""
    M, K = x2.shape
    kt = triton.cdiv(K, BLOCK_K)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty(kt, M, dtype=torch.float32, device=x2.device)
    exact = not x2.is_cuda
    _quant_kernel[(M, triton.cdiv(kt, QUANT_GROUPS))](x2, q, s, M, K, kt, x2.stride(0), GROUPS=QUANT_GROUPS,
                                                      BLOCK_K=BLOCK_K, EXACT=exact)
    return q, s


def scaled_mm(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """cuBLAS's blockwise fp8 GEMM (a CUBLAS class): x2 quantized by _quant_kernel, scale_a [M, K/128]
    outer-dim-major, scale_b the transposed view of the [N/128, K/128] block scales."""
    q, qs = quantize(x2)
    return torch._scaled_mm(q, w.t(), scale_a=qs.t(), scale_b=s.t(), out_dtype=x2.dtype)


def gemm(x2: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x2 [M, K] -> [M, N] in x2's dtype with the Triton kernels of cfg."""
    (M, K), N, tile = x2.shape, w.shape[0], cfg.tile
    assert BLOCK_K % tile.block_n == 0 and tile.block_m >= 16, tile                # one weight scale per K tile
    kt = triton.cdiv(K, BLOCK_K)
    tps = triton.cdiv(kt, cfg.split)
    split = triton.cdiv(kt, tps)                                                   # no empty split
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    ws = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    xa, xs = (x2, x2) if tile.fused else quantize(x2)                             # fused: xs is unused
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n), split)
    _gemm_kernel[grid](xa, xs, w, s, ws, M, N, K, kt, tps, xa.stride(0), xs.stride(0), w.stride(0), s.stride(0), N,
                       M * N, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=BLOCK_K, KSTEP=tile.kstep,
                       FUSED=tile.fused, SWAP=tile.swap, PRECISION=dot_precision(w), num_warps=tile.warps,
                       num_stages=tile.stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](ws, out, M * N, split, BLOCK=SUM_BLOCK)
    return out


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, split_k: int | None = None,
                      cfg: Config | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), w [N, K] fp8 e4m3, s [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in x's dtype,
    as kernels.fp8.fp8_linear. cfg forces a config, split_k its split (tests, the sweep)."""
    shape, K = x.shape, x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    assert w.shape == (N, K) and w.stride(1) == 1 and s.stride(1) == 1, (tuple(w.shape), tuple(s.shape))
    assert s.shape == (triton.cdiv(N, BLOCK_K), triton.cdiv(K, BLOCK_K)), (tuple(s.shape), N, K)
    if M == 0:
        return torch.empty(*shape[:-1], N, dtype=x.dtype, device=x.device)
    if cfg is None:
        cublas = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        cfg = lookup(N, K, M, device_sms(x.device), cublas)
        if cfg is CUBLAS:
            return scaled_mm(x2, w, s).view(*shape[:-1], N)
    if split_k is not None:
        cfg = cfg._replace(split=split_k)
    return gemm(x2, w, s, cfg).view(*shape[:-1], N)
