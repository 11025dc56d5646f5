"""Fused routed-expert MoE in Triton with no host sync: pairs grouped on the device, two grouped GEMMs.

x [N, D] routed top-k to global expert ids [N, k] with weights [N, k]; this rank holds experts
[first, first + E) as stacked weights w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I].
    y[t] = sum_s weights[t, s] * w2[e] (silu(w13[e, :I] x[t]) * w13[e, I:] x[t]),  e = ids[t, s] local
Pairs routed to another rank's experts contribute zero (the EP all-reduce adds them elsewhere).
`shared` = (sw13 [2S, D] (gate rows, then up rows), sw2 [D, S]), S a multiple of I: this rank's shared experts,
read in place as S / I more experts that every token takes with weight 1 (kernels/triton_moe_group.py), so the
shared experts cost no launch of their own.

1. `group_pairs` (kernels/triton_moe_group.py) groups the N*k (token, slot) pairs by expert in blocks of
   BLOCK_M rows; the grids below have one program per (block, column tile) and blocks past the last used
   one return at once (the block count is bounded by shapes alone, tight at decode sizes).
2. `_gate_up_kernel`, grid (blocks, cdiv(I, BLOCK_N)): h = silu(x W_gate^T) * (x W_up^T) per block, in x's dtype.
3. `_down_kernel`, grid (blocks, cdiv(D, BLOCK_N), SPLIT_K): part[split, pair] = weight * (h W_down^T) over the
   split's share of I, one row per pair.
4. `sum_pairs`: y[t] = sum over t's pairs and splits, a fixed order (deterministic, no atomics).
Tiles come from kernels/moe_tiles.py (decode classes, batch path). Runs compiled on CUDA tensors, or on CPU
tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_tiles
from kernels.triton_dot import dot, dot_precision
from kernels.triton_moe_group import block_rows, group_pairs, pair_weight, sum_pairs

moe_align = group_pairs            # the grouping's former name


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, sw_ptr, pair_ptr, blk_ptr, h_ptr, s_xn, s_we, s_wn, s_swn, s_hm, D, I, S, E,
                    TOPK, SHARED, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    e, rows, pair, live = block_rows(pair_ptr, blk_ptr, BLOCK_M)
    if e >= E:
        return
    tok = pair // (TOPK + SHARED)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # intermediate features
    cm = cols < I
    if e < E - SHARED:                                                            # a routed expert
        wg_ptr = w_ptr + e * s_we + cols[None, :] * s_wn                         # [1, BN] gate rows
        up = I * s_wn                                                             # its up rows: I rows on
    else:                                                                         # a chunk of the shared experts
        wg_ptr = sw_ptr + ((e - (E - SHARED)) * I + cols[None, :]) * s_swn
        up = S * s_swn
    g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < D
        a = tl.load(x_ptr + tok[:, None] * s_xn + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        wm = km[:, None] & cm[None, :]
        wg = tl.load(wg_ptr + k[:, None], mask=wm, other=0.0).to(a.dtype)      # [BK, BN] transposed tiles
        wu = tl.load(wg_ptr + up + k[:, None], mask=wm, other=0.0).to(a.dtype)
        g += dot(a, wg, PRECISION)
        u += dot(a, wu, PRECISION)
    h = g / (1.0 + tl.exp(-g)) * u                                                # silu(gate) * up
    tl.store(h_ptr + rows[:, None] * s_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, sw_ptr, pair_ptr, blk_ptr, rw_ptr, out_ptr, s_hm, s_we, s_wn, s_swn, s_os, s_on, D,
                 I, E, TOPK, SHARED, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e, rows, pair, live = block_rows(pair_ptr, blk_ptr, BLOCK_M)
    if e >= E:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # output features
    cm = cols < D
    split = tl.program_id(2)
    k_lo = split * K_PER_SPLIT                                                   # this split's share of I
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, I)
    if e < E - SHARED:
        w_rows = w_ptr + e * s_we + cols[None, :] * s_wn                         # [1, BN] rows of W_down
    else:                                                                         # columns of the shared W_down
        w_rows = sw_ptr + (e - (E - SHARED)) * I + cols[None, :] * s_swn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        a = tl.load(h_ptr + rows[:, None] * s_hm + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=km[:, None] & cm[None, :], other=0.0).to(a.dtype)
        acc += dot(a, w, PRECISION)
    rw = pair_weight(rw_ptr, pair, live, TOPK, SHARED)
    tl.store(out_ptr + split * s_os + pair[:, None] * s_on + cols[None, :],
             (acc * rw[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None] & cm[None, :])


def split_k(I: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, K per split): I's K tiles shared out over at most `split` programs, none empty."""
    tiles = triton.cdiv(I, block_k)
    per = triton.cdiv(tiles, max(1, min(split, tiles)))
    return triton.cdiv(tiles, per), per * block_k


def part_buffer(split: int, pairs: int, D: int, x: torch.Tensor) -> torch.Tensor:
    # per-pair results [split, N*k, D]: fp32 when splits are summed, else x's dtype (half the bytes at large N)
    return torch.empty(split, pairs, D, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)


def shared_chunks(shared: tuple[torch.Tensor, ...] | None, I: int, D: int) -> tuple[int, int]:
    """(S, S / I) of shared = (sw13 [2S, D], ..., sw2 [D, S], ...) ((0, 0) for None): its chunks of I."""
    if shared is None:
        return 0, 0
    sw13, sw2 = shared[0], shared[len(shared) // 2]
    S = sw2.shape[1]
    assert sw13.shape == (2 * S, D) and sw2.shape == (D, S) and S % I == 0, (tuple(sw13.shape), tuple(sw2.shape), I)
    assert sw13.stride(1) == 1 and sw2.stride(1) == 1
    return S, S // I


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, first: int, block_m: int | None = None, tiles=None,
                     add: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """x [N, D], w13 [E, 2I, D], w2 [E, D, I], weights [N, k] (fp32), ids [N, k] global expert ids,
    first: this rank's first expert -> [N, D] in x's dtype (this rank's experts only), plus add [N, D] if given,
    plus the shared experts (sw13 [2S, D], sw2 [D, S]) if given.
    block_m, tiles ((gate/up, down) tiles, kernels/moe_tiles.py): forced (tests, sweeps); else from shapes."""
    N, D = x.shape
    E, I2, _ = w13.shape
    I, k = I2 // 2, ids.shape[1]
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I), (tuple(w13.shape), tuple(w2.shape))
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    S, c = shared_chunks(shared, I, D)
    ids = ids.contiguous()                                                        # the kernels index it [N, k]
    sw13, sw2 = shared or (w13, w2)
    if N == 0:
        return torch.zeros(0, D, dtype=x.dtype, device=x.device) if add is None else add.clone()
    pairs, E = N * (k + c), E + c                                                 # the shared chunks as experts
    block_m = block_m or moe_tiles.block_m(N, pairs, E)
    tiles = tiles or moe_tiles.moe_tiles("bf16", N, pairs, D, I, block_m)
    (bn, bk, warps, stages, _), (bn2, bk2, warps2, stages2, split) = tiles
    pair_ids, block_expert = group_pairs(ids, first, E, block_m, shared=c)
    blocks = block_expert.shape[0]
    h = torch.empty(blocks * block_m, I, dtype=x.dtype, device=x.device)         # [M_pad, I]
    rw = weights.reshape(-1).float().contiguous()                                 # [N*k]
    prec = dot_precision(x)
    _gate_up_kernel[(blocks, triton.cdiv(I, bn))](
        x, w13, sw13, pair_ids, block_expert, h, x.stride(0), w13.stride(0), w13.stride(1), sw13.stride(0),
        h.stride(0), D, I, S, E, k, c, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=prec, num_warps=warps,
        num_stages=stages)
    split, per = split_k(I, bk2, split)
    part = part_buffer(split, pairs, D, x)
    _down_kernel[(blocks, triton.cdiv(D, bn2), split)](
        h, w2, sw2, pair_ids, block_expert, rw, part, h.stride(0), w2.stride(0), w2.stride(1), sw2.stride(0),
        part.stride(0), part.stride(1), D, I, E, k, c, per, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2,
        PRECISION=prec, num_warps=warps2, num_stages=stages2)
    return sum_pairs(part, ids, first, E, x.dtype, add, shared=c)
