"""Fused routed-expert MoE with fp8 block-scaled experts in Triton: kernels/triton_moe.py's grouping and layout (no
host sync), with DeepSeek's fp8 scheme in both grouped GEMMs (kernels/fp8.py).

Experts of this rank: w13 [E, 2I, D] fp8 (gate rows, then up rows) with s13 [E, 2 IB, DB] fp32 (gate scale
blocks, then up's; IB = ceil(I/128), DB = ceil(D/128)), w2 [E, D, I] fp8 with s2 [E, DB, IB].
  1. `group_and_quant`: the pairs grouped (kernels/triton_moe_group.py) and x quantized once per row per 128 columns
     (not per program per K tile), one launch at decode sizes.
  2. `_gate_up_kernel`, grid (blocks, cdiv(I, BLOCK_N)): g, u = x_q W^T promoted per 128-block with both scales,
     h = silu(g) * u rounded to x's dtype; a BLOCK_N of 128 quantizes h in the epilogue, a smaller one stores h
     and `quant_act` quantizes it.
  3. `_down_kernel`, grid (blocks, cdiv(D, BLOCK_N), SPLIT_K): part[split, pair] = routing weight * (h_q W_down^T)
     over the split's 128-blocks of I; `sum_pairs` adds a token's pairs and splits in a fixed order (no atomics).
`shared` = (sw13 [2S, D], ss13 [2 SB, DB], sw2 [D, S], ss2 [DB, SB]), S a multiple of I and of 128: this rank's shared
experts read in place as S / I more experts every token takes (kernels/triton_moe.py). Reference:
kernels.fp8.fused_moe_fp8. Runs compiled on CUDA tensors, or under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_tiles
from kernels.fp8 import FP8
from kernels.triton_dot import dot, dot_precision
from kernels.triton_fp8 import BLOCK_K, quant_rows
from kernels.triton_moe import part_buffer, shared_chunks, split_k
from kernels.triton_moe_group import block_rows, group_body, group_launch, pair_weight, sum_pairs


@triton.jit
def _quant_tile(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm, rb, kb, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                EXACT: tl.constexpr):
    # rows block rb x 128-column group kb: q = x / s in fp8, s = amax / 448 (kernels/fp8.quantize_act)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rm = rows < M
    m = rm[:, None] & (k < K)[None, :]
    r64 = rows[:, None].to(tl.int64)
    q, s = quant_rows(tl.load(x_ptr + r64 * s_xm + k[None, :], mask=m, other=0.0).to(tl.float32), EXACT)
    tl.store(q_ptr + r64 * s_qm + k[None, :], q, mask=m)
    tl.store(s_ptr + rows.to(tl.int64) * s_sm + kb, s, mask=rm)


@triton.jit(do_not_specialize=["M"])
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  EXACT: tl.constexpr):
    _quant_tile(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm, tl.program_id(0), tl.program_id(1), BLOCK_R, BLOCK_K,
                EXACT)


@triton.jit(do_not_specialize=["Nk", "max_blocks", "M"])   # one variant for all call sizes
def _prologue_kernel(ids_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED, x_ptr, q_ptr, s_ptr, M,
                     K, s_xm, s_qm, s_sm, NB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    # one launch at decode sizes: program 0 groups the pairs, programs 1.. quantize x (a tile each)
    pid = tl.program_id(0)
    if pid == 0:
        group_body(ids_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED, NB, P, BLOCK_M, FILL)
    else:
        kbs = tl.cdiv(K, BLOCK_K)
        _quant_tile(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm, (pid - 1) // kbs, (pid - 1) % kbs, BLOCK_R,
                    BLOCK_K, EXACT)


QUANT_ROWS = 16                    # rows of x a quantizing program takes


def quant_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    return (torch.empty(M, K, dtype=FP8, device=x.device),
            torch.empty(M, triton.cdiv(K, BLOCK_K), dtype=torch.float32, device=x.device))


def quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scales [M, ceil(K/128)] fp32), as kernels.fp8.quantize_act."""
    M, K = x.shape
    q, s = quant_buffers(x)
    if M:
        _quant_act_kernel[(triton.cdiv(M, QUANT_ROWS), s.shape[1])](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=QUANT_ROWS, BLOCK_K=BLOCK_K,
            EXACT=not x.is_cuda)                                                    # interpreted: round exactly
    return q, s


def group_and_quant(x: torch.Tensor, ids: torch.Tensor, first: int, E: int, block_m: int, shared: int = 0):
    """group_pairs(ids) and quant_act(x), in one launch when the grouping is one program -> (pair_ids, block_expert,
    x_q, x_s)."""
    pair_ids, block_expert, launch = group_launch(ids, first, E, block_m, shared=shared)
    if launch is None:
        return (pair_ids, block_expert) + quant_act(x)
    (M, K), (q, s) = x.shape, quant_buffers(x)
    _prologue_kernel[(1 + triton.cdiv(M, QUANT_ROWS) * s.shape[1],)](
        *launch[0], x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), **launch[1], BLOCK_R=QUANT_ROWS,
        BLOCK_K=BLOCK_K, EXACT=not x.is_cuda, num_warps=4)
    return pair_ids, block_expert, q, s


@triton.jit
def _gate_up_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, pair_ptr, blk_ptr, h_ptr, hs_ptr, s_xn,
                    s_xsn, s_we, s_wn, s_se, s_sn, s_swn, s_ssn, s_hm, s_hsm, D, I, S, E, TOPK, SHARED, IB,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUANT_H: tl.constexpr,
                    PRECISION: tl.constexpr):
    e, rows, pair, live = block_rows(pair_ptr, blk_ptr, BLOCK_M)
    if e >= E:
        return
    tok = pair // (TOPK + SHARED)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # intermediate features
    cm = cols < I
    if e < E - SHARED:                                                            # a routed expert
        wg_ptr = w_ptr + e * s_we + cols[None, :] * s_wn                         # [1, BN] gate rows
        sg_ptr = s_ptr + e * s_se + (cols // BLOCK_K) * s_sn                     # [BN] their scale rows
        up, up_s = I * s_wn, IB * s_sn                                            # up rows and scales: I on
    else:                                                                         # a chunk of the shared experts
        c = e - (E - SHARED)
        wg_ptr = sw_ptr + (c * I + cols[None, :]) * s_swn
        sg_ptr = ss_ptr + (c * IB + cols // BLOCK_K) * s_ssn
        up, up_s = S * s_swn, (S // BLOCK_K) * s_ssn
    g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(D, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < D
        aq = tl.load(xq_ptr + tok[:, None] * s_xn + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        a_s = tl.load(xs_ptr + tok * s_xsn + kb, mask=live, other=0.0)          # [BM]
        wm = km[:, None] & cm[None, :]
        wg = tl.load(wg_ptr + k[:, None], mask=wm, other=0.0)                   # [BK, BN] fp8, transposed tiles
        wu = tl.load(wg_ptr + up + k[:, None], mask=wm, other=0.0)
        sg = tl.load(sg_ptr + kb, mask=cm, other=0.0)                            # [BN]
        su = tl.load(sg_ptr + up_s + kb, mask=cm, other=0.0)
        g += dot(aq, wg, PRECISION) * a_s[:, None] * sg[None, :]
        u += dot(aq, wu, PRECISION) * a_s[:, None] * su[None, :]
    h = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)                  # silu(gate) * up, in x's dtype
    out = h_ptr + rows[:, None] * s_hm + cols[None, :]
    if QUANT_H:                                                                   # BLOCK_N = 128: one scale group
        hq, hs = quant_rows(h.to(tl.float32), PRECISION == "upcast")
        tl.store(out, hq, mask=cm[None, :])
        tl.store(hs_ptr + rows * s_hsm + tl.program_id(1), hs)
    else:
        tl.store(out, h.to(h_ptr.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _down_kernel(hq_ptr, hs_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, pair_ptr, blk_ptr, rw_ptr, out_ptr, s_hm, s_hsm, s_we,
                 s_wn, s_se, s_sn, s_swn, s_ssn, s_os, s_on, D, I, E, TOPK, SHARED, K_PER_SPLIT,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e, rows, pair, live = block_rows(pair_ptr, blk_ptr, BLOCK_M)
    if e >= E:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # output features
    cm = cols < D
    kb_lo = tl.program_id(2) * K_PER_SPLIT                                       # this split's 128-blocks of I
    kb_hi = tl.minimum(kb_lo + K_PER_SPLIT, tl.cdiv(I, BLOCK_K))
    if e < E - SHARED:
        w_rows = w_ptr + e * s_we + cols[None, :] * s_wn                         # [1, BN] rows of W_down
        ws_ptr = s_ptr + e * s_se + (cols // BLOCK_K) * s_sn                     # [BN] their scale rows
    else:                                                                         # columns of the shared W_down
        c = e - (E - SHARED)
        w_rows = sw_ptr + c * I + cols[None, :] * s_swn
        ws_ptr = ss_ptr + c * tl.cdiv(I, BLOCK_K) + (cols // BLOCK_K) * s_ssn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < I
        aq = tl.load(hq_ptr + rows[:, None] * s_hm + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        a_s = tl.load(hs_ptr + rows * s_hsm + kb, mask=live, other=0.0)         # [BM]
        w = tl.load(w_rows + k[:, None], mask=km[:, None] & cm[None, :], other=0.0)
        ws = tl.load(ws_ptr + kb, mask=cm, other=0.0)
        acc += dot(aq, w, PRECISION) * a_s[:, None] * ws[None, :]
    rw = pair_weight(rw_ptr, pair, live, TOPK, SHARED)
    tl.store(out_ptr + tl.program_id(2) * s_os + pair[:, None] * s_on + cols[None, :],
             (acc * rw[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None] & cm[None, :])


def fused_moe_fp8_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         weights: torch.Tensor, ids: torch.Tensor, first: int, block_m: int | None = None,
                         tiles=None, add: torch.Tensor | None = None,
                         shared: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x [N, D] (bf16 / fp16 / fp32), w13 [E, 2I, D] fp8, s13 [E, 2 IB, DB], w2 [E, D, I] fp8, s2 [E, DB, IB],
    weights [N, k] fp32, ids [N, k] global expert ids, first: this rank's first expert -> [N, D] in x's dtype
    (plus add [N, D] if given, plus the shared experts (sw13, ss13, sw2, ss2) if given).
    block_m, tiles ((gate/up, down) tiles, kernels/moe_tiles.py): forced (tests, sweeps); else from shapes."""
    N, D = x.shape
    E, I2, _ = w13.shape
    I, k = I2 // 2, ids.shape[1]
    IB, DB = triton.cdiv(I, BLOCK_K), triton.cdiv(D, BLOCK_K)
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I), (tuple(w13.shape), tuple(w2.shape))
    assert s13.shape == (E, 2 * IB, DB) and s2.shape == (E, DB, IB), (tuple(s13.shape), tuple(s2.shape))
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1 and s13.stride(2) == 1 and s2.stride(2) == 1
    S, c = shared_chunks(shared, I, D)
    ids = ids.contiguous()                                                        # the kernels index it [N, k]
    sw13, ss13, sw2, ss2 = shared or (w13, s13, w2, s2)
    assert not c or (I % BLOCK_K == 0 and ss13.shape == (2 * S // BLOCK_K, DB) and ss2.shape == (DB, S // BLOCK_K)
                     and ss13.stride(1) == 1 and ss2.stride(1) == 1), (I, tuple(ss13.shape), tuple(ss2.shape))
    if N == 0:
        return torch.zeros(0, D, dtype=x.dtype, device=x.device) if add is None else add.clone()
    pairs, E = N * (k + c), E + c                                                 # the shared chunks as experts
    block_m = block_m or moe_tiles.block_m(N, pairs, E)
    tiles = tiles or moe_tiles.moe_tiles("fp8", N, pairs, D, I, block_m)
    (bn, _, warps, stages, _), (bn2, _, warps2, stages2, split) = tiles
    pair_ids, block_expert, xq, xs = group_and_quant(x, ids, first, E, block_m, shared=c)
    blocks = block_expert.shape[0]
    fused = bn == BLOCK_K                                                         # h quantized in the epilogue
    h = torch.empty(blocks * block_m, I, dtype=FP8 if fused else x.dtype, device=x.device)   # [M_pad, I]
    hs = torch.empty(blocks * block_m, IB, dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()                                 # [N*k]
    prec = dot_precision(w13)
    _gate_up_kernel[(blocks, triton.cdiv(I, bn))](
        x, xq, xs, w13, s13, sw13, ss13, pair_ids, block_expert, h, hs, xq.stride(0), xs.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), sw13.stride(0), ss13.stride(0), h.stride(0), hs.stride(0), D, I,
        S, E, k, c, IB, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, QUANT_H=fused, PRECISION=prec,
        num_warps=warps, num_stages=stages)
    if not fused:
        h, hs = quant_act(h)
    split, per = split_k(I, BLOCK_K, split)
    part = part_buffer(split, pairs, D, x)
    _down_kernel[(blocks, triton.cdiv(D, bn2), split)](
        h, hs, w2, s2, sw2, ss2, pair_ids, block_expert, rw, part, h.stride(0), hs.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), sw2.stride(0), ss2.stride(0), part.stride(0), part.stride(1), D, I,
        E, k, c, per // BLOCK_K, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=BLOCK_K, PRECISION=prec, num_warps=warps2,
        num_stages=stages2)
    return sum_pairs(part, ids, first, E, x.dtype, add, shared=c)
