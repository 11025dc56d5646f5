"""Fused routed-expert MoE with fp8 block-scaled experts in Triton: kernels/triton_moe.py's layout and device-side
grouping (moe_align: no host sync), with DeepSeek's fp8 scheme in both grouped GEMMs (kernels/fp8.py).

Experts of this rank: w13 [E, 2I, D] fp8 (gate rows, then up rows) with s13 [E, 2 IB, DB] fp32 (gate scale
blocks, then up's; IB = ceil(I/128), DB = ceil(D/128)), w2 [E, D, I] fp8 with s2 [E, DB, IB].
  1. `_gate_up_kernel`, grid (max_blocks, cdiv(I, BLOCK_N)): each 128-column tile of the block's token rows is
     quantized to fp8 once (per row) and used for gate and up; h = silu(g) * u in fp32, stored in x's dtype.
  2. `_down_kernel`, grid (max_blocks, cdiv(D, BLOCK_N)): h quantized per row per 128 columns, out[pair] =
     routing weight * (h_q W_down^T); y = out.view(N, k, D).sum(1) (fixed order, no atomics).
Reference: kernels.fp8.fused_moe_fp8. Runs compiled on CUDA tensors, or under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision
from kernels.triton_fp8 import BLOCK_K, quant_rows
from kernels.triton_moe import moe_align


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, pair_ptr, blk_ptr, h_ptr, s_xn, s_we, s_wn, s_se, s_sn, s_hm,
                    D, I, E, TOPK, IB, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_TILES: tl.constexpr, PRECISION: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    e = tl.load(blk_ptr + blk).to(tl.int64)
    if e >= E:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows).to(tl.int64)
    live = pair >= 0
    tok = tl.where(live, pair, 0) // TOPK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # intermediate features
    cm = cols < I
    g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(K_TILES):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < D
        a = tl.load(x_ptr + tok[:, None] * s_xn + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        aq, a_s = quant_rows(a.to(tl.float32), PRECISION == "upcast")                                    # [BM, BK] fp8, [BM]
        w = w_ptr + e * s_we + k[:, None]                                         # [BK, BN] transposed tiles
        wg = tl.load(w + cols[None, :] * s_wn, mask=km[:, None] & cm[None, :], other=0.0)
        wu = tl.load(w + (cols + I)[None, :] * s_wn, mask=km[:, None] & cm[None, :], other=0.0)
        sc = s_ptr + e * s_se + (cols // BLOCK_K) * s_sn + kb
        sg = tl.load(sc, mask=cm, other=0.0)                                      # [BN]
        su = tl.load(sc + IB * s_sn, mask=cm, other=0.0)
        g += dot(aq, wg, PRECISION) * a_s[:, None] * sg[None, :]
        u += dot(aq, wu, PRECISION) * a_s[:, None] * su[None, :]
    h = g / (1.0 + tl.exp(-g)) * u                                                # silu(gate) * up
    tl.store(h_ptr + rows[:, None] * s_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, pair_ptr, blk_ptr, rw_ptr, out_ptr, s_hm, s_we, s_wn, s_se, s_sn, s_on,
                 D, I, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_TILES: tl.constexpr, PRECISION: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    e = tl.load(blk_ptr + blk).to(tl.int64)
    if e >= E:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows).to(tl.int64)
    live = pair >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # output features
    cm = cols < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(K_TILES):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < I
        a = tl.load(h_ptr + rows[:, None] * s_hm + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        aq, a_s = quant_rows(a.to(tl.float32), PRECISION == "upcast")
        w = tl.load(w_ptr + e * s_we + k[:, None] + cols[None, :] * s_wn, mask=km[:, None] & cm[None, :], other=0.0)
        ws = tl.load(s_ptr + e * s_se + (cols // BLOCK_K) * s_sn + kb, mask=cm, other=0.0)
        acc += dot(aq, w, PRECISION) * a_s[:, None] * ws[None, :]
    safe = tl.where(live, pair, 0)
    rw = tl.load(rw_ptr + safe, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + safe[:, None] * s_on + cols[None, :], (acc * rw[:, None]).to(out_ptr.dtype.element_ty),
             mask=live[:, None] & cm[None, :])


def fused_moe_fp8_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, first: int, block_m: int | None = None) -> torch.Tensor:
    """x [N, D] (bf16 / fp16 / fp32), w13 [E, 2I, D] fp8, s13 [E, 2 IB, DB], w2 [E, D, I] fp8, s2 [E, DB, IB],
    weights [N, k] fp32, ids [N, k] global expert ids, first: this rank's first expert -> [N, D] in x's dtype."""
    N, D = x.shape
    E, I2, _ = w13.shape
    I, k = I2 // 2, ids.shape[1]
    IB, DB = triton.cdiv(I, BLOCK_K), triton.cdiv(D, BLOCK_K)
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I), (tuple(w13.shape), tuple(w2.shape))
    assert s13.shape == (E, 2 * IB, DB) and s2.shape == (E, DB, IB), (tuple(s13.shape), tuple(s2.shape))
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1 and s13.stride(2) == 1 and s2.stride(2) == 1
    if block_m is None:          # from shapes only: fixed for a captured batch size
        block_m = 16 if N * k <= 64 * E else 64
    pair_ids, block_expert = moe_align(ids, first, E, block_m)
    max_blocks = block_expert.shape[0]
    h = torch.empty(max_blocks * block_m, I, dtype=x.dtype, device=x.device)      # [M_pad, I]
    out = torch.zeros(N * k, D, dtype=x.dtype, device=x.device)                   # [N*k, D] per pair
    if N == 0:
        return out.view(N, k, D).sum(1)
    rw = weights.reshape(-1).float().contiguous()                                 # [N*k]
    prec, bn = dot_precision(w13), 64
    _gate_up_kernel[(max_blocks, triton.cdiv(I, bn))](
        x, w13, s13, pair_ids, block_expert, h, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), h.stride(0), D, I, E, k, IB, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, K_TILES=DB,
        PRECISION=prec, num_warps=4, num_stages=3)
    _down_kernel[(max_blocks, triton.cdiv(D, bn))](
        h, w2, s2, pair_ids, block_expert, rw, out, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), out.stride(0), D, I, E, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, K_TILES=IB,
        PRECISION=prec, num_warps=4, num_stages=3)
    return out.view(N, k, D).sum(1)
