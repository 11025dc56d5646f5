"""The fused MoE's grouping of (token, slot) pairs by expert and back, shared by the bf16 and the fp8 kernels
(kernels/triton_moe.py, kernels/triton_fp8_moe.py). No host sync: every size comes from shapes alone.

ids [N, k] global expert ids; this rank holds experts [first, first + E). With `shared` > 0 the last `shared` local
experts are chunks of the shared experts, which every token takes with weight 1: a token has k + shared pairs (pair
p = t*(k + shared) + s: slots s < k routed by ids[t, s], then one a chunk), grouped as routed ones. The pairs are
grouped by local expert into blocks of BLOCK_M rows: expert e owns whole blocks, its pairs fill their first rows,
the rest are padding (-1). Pairs routed to another rank's experts get no row (they contribute zero here).
  * `group_pairs` -> pair_ids [max_blocks * BLOCK_M] int32 (pair of each row, -1 for padding) and block_expert
    [max_blocks] int32 (local expert of each block; E past the last used block). max_blocks = min(N*k,
    cdiv(N*k, BLOCK_M) + E) bounds the used blocks (each holds >= 1 pair), so the grouped kernels' grids are fixed
    by shapes and their dead programs few. Up to ONE_PROGRAM_PAIRS pairs one program sorts the pairs (rows in pair
    order within an expert: deterministic; `group_body`, which another kernel may run in one of its programs);
    beyond, two kernels (a histogram, an atomic placement).
  * `block_rows`: the grouped kernels' prologue (the expert of their block, its rows, pairs and liveness).
  * `sum_pairs` -> y [N, D]: each token's pair results (one partial per K split) summed in a fixed order
    (deterministic: no atomics); pairs of other ranks' experts are skipped.
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ONE_PROGRAM_PAIRS = 1024           # up to this many pairs the one-program grouping (sort in registers)
FILL = 1024                        # elements a program fills per step


@triton.jit
def _expert_of(ids_ptr, i, Nk, first, E, TOPK, SHARED):
    # local expert of pairs i (E: another rank's expert, or past the end); slots past TOPK: shared chunks E - SHARED ..
    ks = TOPK + SHARED
    s = i % ks
    routed = s < TOPK
    e = tl.load(ids_ptr + (i // ks) * TOPK + s, mask=(i < Nk) & routed, other=-1).to(tl.int32) - first
    ok = tl.where(routed, (e >= 0) & (e < E - SHARED), True)
    e = tl.where(routed, e, E - SHARED + s - TOPK)
    return tl.where((i < Nk) & ok, e, E)


@triton.jit
def _fill(ptr, n, value, FILL: tl.constexpr):
    for i0 in range(0, n, FILL):
        i = i0 + tl.arange(0, FILL)
        tl.store(ptr + i, tl.zeros([FILL], tl.int32) + value, mask=i < n)


@triton.jit
def group_body(ids_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED,
               NB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr):
    """The one-program grouping (a kernel may run it in one of its programs): sort the pairs by (expert, pair);
    expert e's blocks follow those of experts < e."""
    i = tl.arange(0, P)
    e = _expert_of(ids_ptr, i, Nk, first, E, TOPK, SHARED)                      # [P]
    cnt = tl.histogram(e, NB)                                                   # [NB] pairs per expert (bin E: none)
    ex = tl.arange(0, NB)
    blocks = tl.where(ex < E, (cnt + BLOCK_M - 1) // BLOCK_M, 0)
    row0 = (tl.cumsum(blocks, 0) - blocks) * BLOCK_M                              # [NB] first row of each expert
    pos0 = tl.cumsum(cnt, 0) - cnt                                               # [NB] its first pair, sorted
    key = tl.sort(e * P + i)                                                    # [P] by expert, then pair
    es, ps = key // P, key % P
    live = es < E
    ec = tl.where(live, es, 0)
    rank = i - tl.gather(pos0, ec, 0)                                           # place among its expert's pairs
    row = tl.gather(row0, ec, 0) + rank
    _fill(pair_ptr, max_blocks * BLOCK_M, -1, FILL)
    _fill(blk_ptr, max_blocks, E, FILL)
    tl.debug_barrier()                                                          # the fills land before the rows
    tl.store(pair_ptr + row, ps, mask=live)
    tl.store(blk_ptr + row // BLOCK_M, es, mask=live & (rank % BLOCK_M == 0))   # each block's first row names it


@triton.jit(do_not_specialize=["Nk", "max_blocks"])   # one variant for all call sizes
def _group_kernel(ids_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED,
                  NB: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr):
    group_body(ids_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED, NB, P, BLOCK_M, FILL)


@triton.jit(do_not_specialize=["Nk"])   # one variant for all call sizes (a new size class mid-serving compiled)
def _count_kernel(ids_ptr, cnt_ptr, Nk, first, E, TOPK, SHARED, NB: tl.constexpr, BLOCK: tl.constexpr):
    # cnt[e] += pairs of this chunk routed to local expert e (bin E: not local)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(cnt_ptr + tl.arange(0, NB), tl.histogram(_expert_of(ids_ptr, i, Nk, first, E, TOPK, SHARED), NB))


@triton.jit(do_not_specialize=["Nk", "max_blocks"])
def _place_kernel(ids_ptr, cnt_ptr, fill_ptr, pair_ptr, blk_ptr, Nk, first, E, max_blocks, TOPK, SHARED,
                  NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # expert e owns blocks [end_e - blocks_e, end_e); each pair takes the next free row of its expert
    # (atomic: the order inside an expert's rows varies, no row's result depends on it)
    ex = tl.arange(0, NB)
    blocks = (tl.load(cnt_ptr + ex, mask=ex < E, other=0) + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(blocks, 0)                                                   # [NB] inclusive
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = _expert_of(ids_ptr, i, Nk, first, E, TOPK, SHARED)
    live = e < E
    slot = tl.atomic_add(fill_ptr + e, 1, mask=live)
    row = tl.gather((end - blocks) * BLOCK_M, tl.where(live, e, 0), 0) + slot
    tl.store(pair_ptr + row, i, mask=live)
    # the expert of blocks i: how many experts end at or before it (E past the last used block)
    owner = tl.sum(((end[None, :] <= i[:, None]) & (ex < E)[None, :]).to(tl.int32), 1)
    tl.store(blk_ptr + i, owner, mask=i < max_blocks)


def max_blocks_of(pairs: int, num_local: int, block_m: int) -> int:
    return min(pairs, triton.cdiv(pairs, block_m) + num_local)


def group_launch(ids: torch.Tensor, first: int, num_local: int, block_m: int, one_program: bool | None = None,
                 shared: int = 0):
    """The grouping's buffers, pair_ids [max_blocks * block_m] int32 (pair t*(k + shared) + s, -1 for padding) and
    block_expert [max_blocks] int32 (local expert of each block, num_local past the last used block), and either the
    arguments (args, constexprs) of `group_body` in one program, for the caller to launch (alone or inside its own
    kernel), or None: the two-kernel grouping has run. num_local counts the `shared` chunks (the last local
    experts). one_program forces a grouping; default by pair count."""
    (N, k), E = ids.shape, num_local
    dev, Nk = ids.device, N * (k + shared)
    max_blocks = max_blocks_of(Nk, E, block_m)
    nb = triton.next_power_of_2(E + 1)
    ids = ids.reshape(-1)
    pair_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if one_program if one_program is not None else Nk <= ONE_PROGRAM_PAIRS:
        p = 64 if Nk <= 64 else 256 if Nk <= 256 else triton.next_power_of_2(Nk)   # few compiled variants
        launch = ((ids, pair_ids, block_expert, Nk, first, E, max_blocks, k, shared),
                  dict(NB=nb, P=p, BLOCK_M=block_m, FILL=FILL))
        return pair_ids, block_expert, launch
    counts = torch.zeros(2, nb, dtype=torch.int32, device=dev)                   # [counts | next free row]
    pair_ids.fill_(-1)
    block = 128 if nb <= 256 else 32
    _count_kernel[(triton.cdiv(Nk, block),)](ids, counts, Nk, first, E, k, shared, NB=nb, BLOCK=block)
    _place_kernel[(triton.cdiv(max(Nk, max_blocks), block),)](ids, counts, counts[1], pair_ids, block_expert, Nk,
                                                              first, E, max_blocks, k, shared, NB=nb,
                                                              BLOCK_M=block_m, BLOCK=block)
    return pair_ids, block_expert, None


def group_pairs(ids: torch.Tensor, first: int, num_local: int, block_m: int, one_program: bool | None = None,
                shared: int = 0):
    """ids [N, k] global expert ids -> (pair_ids, block_expert) as `group_launch` describes. At least one pair."""
    pair_ids, block_expert, launch = group_launch(ids, first, num_local, block_m, one_program, shared)
    if launch:
        _group_kernel[(1,)](*launch[0], **launch[1], num_warps=4)
    return pair_ids, block_expert


@triton.jit
def pair_weight(rw_ptr, pair, live, TOPK, SHARED):
    """Routing weights [BM] fp32 of pairs (t*(TOPK + SHARED) + s) from rw [N, TOPK]; a shared chunk's is 1."""
    ks = TOPK + SHARED
    s = pair % ks
    return tl.load(rw_ptr + (pair // ks) * TOPK + s, mask=live & (s < TOPK), other=1.0).to(tl.float32)


@triton.jit
def block_rows(pair_ptr, blk_ptr, BLOCK_M: tl.constexpr):
    """The grouped kernels' prologue: block program_id(0) -> (its local expert (>= E: dead block, return), its rows
    [BM] in the grouped layout, their pairs [BM] (0 for padding), live [BM]). Both loads are issued together.
    Blocks are the grid's fastest axis, so an expert's blocks (the shared chunks' many, at a verify of 128 tokens)
    read a weight tile one after another, from L2 after the first."""
    blk = tl.program_id(0).to(tl.int64)
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows).to(tl.int64)
    e = tl.load(blk_ptr + blk).to(tl.int64)
    live = pair >= 0
    return e, rows, tl.where(live, pair, 0), live


@triton.jit
def _sum_pairs_kernel(part_ptr, ids_ptr, y_ptr, add_ptr, first, E, TOPK, SHARED, D, s_split, s_pair, s_yn, s_an,
                      KP: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    # y[t, cols] = sum over K splits of (sum over t's slots s, local experts and shared chunks only, of
    # part[split, t*(k + shared) + s, cols]): all slots loaded at once (two dependent loads, not 2k), each sum in a
    # fixed order (no atomics)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, KP)
    p = t * (TOPK + SHARED) + s                                                 # [KP] pairs of token t
    e = tl.load(ids_ptr + t * TOPK + s, mask=s < TOPK, other=-1).to(tl.int32) - first
    live = tl.where(s < TOPK, (e >= 0) & (e < E - SHARED), s < TOPK + SHARED)
    m = live[:, None] & (cols < D)[None, :]                                     # [KP, BLOCK]
    acc = tl.zeros([BLOCK], tl.float32)
    for sp in tl.static_range(SPLIT):
        v = tl.load(part_ptr + sp * s_split + p[:, None] * s_pair + cols[None, :], mask=m, other=0.0)
        acc += tl.sum(v.to(tl.float32), 0)
    dt = y_ptr.dtype.element_ty
    y = acc.to(dt)
    if ADD:                                   # + add[t] (the shared experts), rounded as torch's add after the sum
        y = (y.to(tl.float32) + tl.load(add_ptr + t * s_an + cols, mask=cols < D, other=0.0).to(tl.float32)).to(dt)
    tl.store(y_ptr + t * s_yn + cols, y, mask=cols < D)


def sum_pairs(part: torch.Tensor, ids: torch.Tensor, first: int, num_local: int, dtype: torch.dtype,
              add: torch.Tensor | None = None, shared: int = 0) -> torch.Tensor:
    """part [SPLIT, N*(k + shared), D] per-pair results (rows of other ranks' pairs never written), ids [N, k] ->
    y [N, D]; add [N, D] (the shared experts' output where not among the pairs): y + add, as the sum in y's dtype
    plus add would round."""
    split, Nk, D = part.shape
    N, k = ids.shape
    y = torch.empty(N, D, dtype=dtype, device=part.device)
    if N:
        kp = triton.next_power_of_2(k + shared)
        block = min(triton.next_power_of_2(D), 4096 // kp)                         # a [kp, block] tile per split
        if add is not None:
            assert add.shape == (N, D) and add.stride(1) == 1, (tuple(add.shape), add.stride())
        a = add if add is not None else y
        _sum_pairs_kernel[(N, triton.cdiv(D, block))](part, ids, y, a, first, num_local, k, shared, D,
                                                      part.stride(0), part.stride(1), y.stride(0), a.stride(0),
                                                      KP=kp, SPLIT=split, BLOCK=block, ADD=add is not None)
    return y
