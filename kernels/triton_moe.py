"""Fused routed-expert MoE in Triton with no host sync: align on the device, two grouped GEMMs.

x [N, D] routed top-k to global expert ids [N, k] with weights [N, k]; this rank holds experts
[first, first + E) as stacked weights w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I].
    y[t] = sum_s weights[t, s] * w2[e] (silu(w13[e, :I] x[t]) * w13[e, I:] x[t]),  e = ids[t, s] local
Pairs routed to another rank's experts contribute zero (the EP all-reduce adds them elsewhere).

1. `moe_align` groups the N*k (token, slot) pairs by expert and pads each expert's rows to whole
   blocks of BLOCK_M: at most cdiv(N*k, BLOCK_M) + E blocks, a bound known from shapes alone. Two
   small kernels (a histogram, then a placement): no .item(), no sync.
2. `_gate_up_kernel`, grid (max_blocks, cdiv(I, BLOCK_N)): h = silu(x W_gate^T) * (x W_up^T) per block,
   with that block's expert; blocks past the last expert return at once.
3. `_down_kernel`, grid (max_blocks, cdiv(D, BLOCK_N)): out[pair] = weight * (h W_down^T), one row
   per pair; y = out.view(N, k, D).sum(1), a fixed order (deterministic, no atomics).
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision


@triton.jit
def _expert_of(ids_ptr, i, Nk, first, E):
    # local expert of pairs i (E: another rank's expert, or past the end)
    e = tl.load(ids_ptr + i, mask=i < Nk, other=-1).to(tl.int32) - first
    return tl.where((i < Nk) & (e >= 0) & (e < E), e, E)


@triton.jit
def _count_kernel(ids_ptr, cnt_ptr, Nk, first, E, NB: tl.constexpr, BLOCK: tl.constexpr):
    # cnt[e] += pairs of this chunk routed to local expert e (bin E: not local)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(cnt_ptr + tl.arange(0, NB), tl.histogram(_expert_of(ids_ptr, i, Nk, first, E), NB))


@triton.jit
def _place_kernel(ids_ptr, cnt_ptr, fill_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks,
                  NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # expert e owns blocks [end_e - blocks_e, end_e); each pair takes the next free row of its expert
    # (atomic: the order inside an expert's rows varies, no row's result depends on it)
    ex = tl.arange(0, NB)
    blocks = (tl.load(cnt_ptr + ex, mask=ex < E, other=0) + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(blocks, 0)                                                   # [NB] inclusive
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = _expert_of(ids_ptr, i, Nk, first, E)
    live = e < E
    slot = tl.atomic_add(fill_ptr + e, 1, mask=live)
    row = tl.gather((end - blocks) * BLOCK_M, tl.where(live, e, 0), 0) + slot
    tl.store(pair_ptr + row, i, mask=live)
    # the expert of blocks i: how many experts end at or before it (E past the last used block)
    owner = tl.sum(((end[None, :] <= i[:, None]) & (ex < E)[None, :]).to(tl.int32), 1)
    tl.store(blk_ptr + i, owner, mask=i < max_blocks)


def moe_align(ids: torch.Tensor, first: int, num_local: int, block_m: int):
    """ids [N, k] global expert ids -> pair_ids [max_blocks * block_m] int32 (pair t*k + s, -1 for
    padding), block_expert [max_blocks] int32 (local expert of each block; num_local past the last
    used block). Two kernels and two fills, whatever N: the sizes come from shapes alone."""
    dev, Nk, E = ids.device, ids.numel(), num_local
    max_blocks = triton.cdiv(Nk, block_m) + E
    nb = triton.next_power_of_2(E + 1)
    counts = torch.zeros(2, nb, dtype=torch.int32, device=dev)                   # [counts | next free row]
    pair_ids = torch.full((max_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    ids = ids.reshape(-1)
    block = 128 if nb <= 256 else 32
    _count_kernel[(max(1, triton.cdiv(Nk, block)),)](ids, counts, Nk, first, E, NB=nb, BLOCK=block)
    _place_kernel[(triton.cdiv(max(Nk, max_blocks), block),)](ids, counts, counts[1], pair_ids, block_expert, Nk,
                                                              first, E, max_blocks, NB=nb, BLOCK_M=block_m,
                                                              BLOCK=block)
    return pair_ids, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, pair_ptr, blk_ptr, h_ptr, s_xn, s_we, s_wn, s_hm, D, I, E, TOPK,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    for t in range(K_TILES):
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < D
        a = tl.load(x_ptr + tok[:, None] * s_xn + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        w = w_ptr + e * s_we + k[:, None]                                         # [BK, BN] transposed tiles
        wg = tl.load(w + cols[None, :] * s_wn, mask=km[:, None] & cm[None, :], other=0.0).to(a.dtype)
        wu = tl.load(w + (cols + I)[None, :] * s_wn, mask=km[:, None] & cm[None, :], other=0.0).to(a.dtype)
        g += dot(a, wg, PRECISION)
        u += dot(a, wu, PRECISION)
    h = g / (1.0 + tl.exp(-g)) * u                                                # silu(gate) * up
    tl.store(h_ptr + rows[:, None] * s_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, pair_ptr, blk_ptr, rw_ptr, out_ptr, s_hm, s_we, s_wn, s_on, D, I, E,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    for t in range(K_TILES):
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < I
        a = tl.load(h_ptr + rows[:, None] * s_hm + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + e * s_we + k[:, None] + cols[None, :] * s_wn, mask=km[:, None] & cm[None, :],
                    other=0.0).to(a.dtype)
        acc += dot(a, w, PRECISION)
    rw = tl.load(rw_ptr + tl.where(live, pair, 0), mask=live, other=0.0).to(tl.float32)
    safe = tl.where(live, pair, 0)
    tl.store(out_ptr + safe[:, None] * s_on + cols[None, :], (acc * rw[:, None]).to(out_ptr.dtype.element_ty),
             mask=live[:, None] & cm[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, first: int, block_m: int | None = None, tiles=None) -> torch.Tensor:
    """x [N, D], w13 [E, 2I, D], w2 [E, D, I], weights [N, k] (fp32), ids [N, k] global expert ids,
    first: this rank's first expert -> [N, D] in x's dtype (this rank's experts only)."""
    N, D = x.shape
    E, I2, _ = w13.shape
    I, k = I2 // 2, ids.shape[1]
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I), (tuple(w13.shape), tuple(w2.shape))
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if block_m is None:          # from shapes only: fixed for a captured batch size
        block_m = 16 if N * k <= 64 * E else 64
    pair_ids, block_expert = moe_align(ids, first, E, block_m)
    max_blocks = block_expert.shape[0]
    h = torch.empty(max_blocks * block_m, I, dtype=x.dtype, device=x.device)      # [M_pad, I]
    out = torch.zeros(N * k, D, dtype=x.dtype, device=x.device)                   # [N*k, D] per pair
    if N == 0:
        return out.view(N, k, D).sum(1)
    rw = weights.reshape(-1).float().contiguous()                                 # [N*k]
    prec = dot_precision(x)
    (bn, bk, warps, stages), (bn2, bk2, warps2, stages2) = tiles or moe_tiles(N * k, E)
    _gate_up_kernel[(max_blocks, triton.cdiv(I, bn))](
        x, w13, pair_ids, block_expert, h, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), D, I, E, k,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, K_TILES=triton.cdiv(D, bk), PRECISION=prec,
        num_warps=warps, num_stages=stages)
    _down_kernel[(max_blocks, triton.cdiv(D, bn2))](
        h, w2, pair_ids, block_expert, rw, out, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), D, I, E,
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, K_TILES=triton.cdiv(I, bk2), PRECISION=prec,
        num_warps=warps2, num_stages=stages2)
    return out.view(N, k, D).sum(1)


def moe_tiles(pairs: int, num_local: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the gate/up and the down kernel, from shapes only (a captured
    batch keeps its tiles). Measured on an H200 at DeepSeek-V2-Lite's shapes (64 experts of 1408, top-6;
    .gpu sweep of 2026-12-01, BENCHMARKS.md): few pairs want narrow column tiles and deep K tiles (more
    programs and more bytes in flight per expert), many pairs wider ones. Was (64, 64, 4, 3) for both."""
    if pairs <= 8:                                   # one or two tokens
        return (32, 128, 4, 5), (32, 128, 4, 5)
    if pairs < 512:
        return (32, 128, 4, 3 if pairs > 64 else 5), (64, 128, 4, 3)
    return (64, 128, 4, 3), (128, 128, 4, 3)
