"""Paged MLA attention in Triton, in the absorbed form, reading the latent cache through block tables.

For query row n of request b = token_request[n] at position pos = positions[n], and each head:
    score_j = (q_lat . c_kv[j] + q_pe . k_pe[j]) * scale          for j < kv_len = min(pos + 1, context_lens[b])
    out     = sum_j softmax(score)_j c_kv[j]                        (fp32 softmax, online over key blocks)
Key j of request b lives at page block_tables[b, j // block_size], row j % block_size. A row whose
kv_len is 0 (graph padding: point it at a request of context length 0) writes zeros.

One program per (query row, block of BLOCK_H heads, split of the keys): the heads share every key (MLA
has one latent KV head), so a key tile [BLOCK_N, R] is loaded once and feeds both dot products. With
S > 1 splits (few rows, long contexts: decode) each split's unnormalized (acc, max, sum) goes to an fp32
workspace and `_combine_kernel` merges them; given counters (`arrivals`) the split that arrives last merges them
in the same launch instead (splits with no key exit, a row of one split writes its output at once; same bits). The grid (N, cdiv(h, BLOCK_H), S) and S come from shapes
alone and nothing is read back to the host: launchable inside a CUDA graph.
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _key_tile(start, q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, lo, hi, s_cb, s_cs, s_kb, s_ks, s_bt,
              block_size, scale_log2, r, p, rm, pm, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # one online-softmax step over keys [start, start + BLOCK_N) ∩ [lo, hi) of request b
    j = start + tl.arange(0, BLOCK_N)
    jm = (j >= lo) & (j < hi)
    return paged_softmax_step(j, jm, jm[None, :], q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, s_cb,
                              s_cs, s_kb, s_ks, s_bt, block_size, scale_log2, r, p, rm, pm, PRECISION)


@triton.jit
def paged_softmax_step(j, jm, sm, q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, s_cb, s_cs, s_kb, s_ks, s_bt,
                       block_size, scale_log2, r, p, rm, pm, PRECISION: tl.constexpr):
    # keys at positions j [BN] of request b (loaded where jm) through its block table: one online-softmax step
    # of the absorbed MLA, scores kept where sm ([1, BN] or per query row [BH, BN]: causal prefill tiles);
    # shared by the dense kernel here, the sparse one (kernels/triton_dsa.py) and the prefill one
    # (kernels/triton_mla_prefill.py)
    page = tl.load(bt_ptr + b * s_bt + j // block_size, mask=jm, other=0).to(tl.int64)
    row = j % block_size
    c = tl.load(ckv_ptr + (page * s_cb + row * s_cs)[:, None] + r[None, :], mask=jm[:, None] & rm[None, :],
                other=0.0).to(q.dtype)                                            # [BN, BR]
    k = tl.load(kpe_ptr + (page * s_kb + row * s_ks)[:, None] + p[None, :], mask=jm[:, None] & pm[None, :],
                other=0.0).to(q.dtype)                                            # [BN, BP]
    s = dot(q, tl.trans(c), PRECISION) + dot(qp, tl.trans(k), PRECISION)          # [BH, BN] fp32
    s = tl.where(sm, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                         # no live key yet
    alpha = tl.exp2(m_i - m_safe)
    e = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(e, 1)
    acc = acc * alpha[:, None] + dot(e.to(c.dtype), c, PRECISION)
    return m_new, l_i, acc


# SPLITS and the tables' width s_bt are run-time values, not specialized: both follow the step's longest request, and
# as constants (or ints specialized on 1 and multiples of 16) each value was a kernel of its own, compiled (0.9 s on
# the H200) by the first eager step that met it mid-serving (BENCHMARKS.md, twenty-fifth session)
@triton.jit(do_not_specialize=["SPLITS", "s_bt"])
def _mla_kernel(ql_ptr, qp_ptr, ckv_ptr, kpe_ptr, bt_ptr, req_ptr, pos_ptr, clen_ptr, out_ptr, ws_ptr, ml_ptr,
                s_qln, s_qlh, s_qpn, s_qph, s_cb, s_cs, s_kb, s_ks, s_bt, s_on, s_oh,
                H, R, P, block_size, scale_log2, SPLITS,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                PER_MIN: tl.constexpr, KV_TILES: tl.constexpr,
                DYNAMIC_LOOP: tl.constexpr, PRECISION: tl.constexpr, cnt_ptr=None, MERGE: tl.constexpr = False):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hm = heads < H
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    rm, pm = r < R, p < P
    b = tl.load(req_ptr + n).to(tl.int64)
    kv_len = tl.minimum(tl.load(pos_ptr + n).to(tl.int32) + 1, tl.load(clen_ptr + b))
    per = tl.maximum(tl.cdiv(tl.cdiv(kv_len, BLOCK_N), SPLITS), PER_MIN)          # key tiles per split
    t0 = split * per
    t1 = tl.minimum(t0 + per, tl.cdiv(kv_len, BLOCK_N))
    lo, hi = t0 * BLOCK_N, tl.minimum(t1 * BLOCK_N, kv_len)                       # this split's keys
    live = tl.maximum(tl.cdiv(tl.cdiv(kv_len, BLOCK_N), per), 1)                  # splits with keys (and split 0)
    if MERGE:
        if split >= live:                 # no key here: nothing to merge (two launches: the combine reads m = -inf)
            return
    q = tl.load(ql_ptr + n * s_qln + heads[:, None] * s_qlh + r[None, :], mask=hm[:, None] & rm[None, :],
                other=0.0)                                                        # [BH, BR]
    qp = tl.load(qp_ptr + n * s_qpn + heads[:, None] * s_qph + p[None, :], mask=hm[:, None] & pm[None, :],
                 other=0.0)                                                       # [BH, BP]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # compiled: loop over this split's own key tiles; interpreted: over KV_TILES, a host constant (the
    # interpreter loops only to constexpr bounds), the keys outside [lo, hi) masked out
    if DYNAMIC_LOOP:
        for t in range(t0, t1):
            m_i, l_i, acc = _key_tile(t * BLOCK_N, q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, lo, hi,
                                      s_cb, s_cs, s_kb, s_ks, s_bt, block_size, scale_log2, r, p, rm, pm,
                                      BLOCK_N, PRECISION)
    else:
        for t in range(KV_TILES):
            m_i, l_i, acc = _key_tile(t * BLOCK_N, q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, lo, hi,
                                      s_cb, s_cs, s_kb, s_ks, s_bt, block_size, scale_log2, r, p, rm, pm,
                                      BLOCK_N, PRECISION)
    omask = hm[:, None] & rm[None, :]
    if SPLITS == 1:
        _finish(acc, l_i, out_ptr + n * s_on + heads[:, None] * s_oh + r[None, :], omask)
    elif MERGE:
        if live == 1:         # the row's one split: its own output, the bits a merge of one split gives
            _finish(acc, l_i, out_ptr + n * s_on + heads[:, None] * s_oh + r[None, :], omask)
        else:                 # the split that arrives last for its (row, head block) merges the row's splits
            row = (n * SPLITS + split) * H + heads
            tl.store(ws_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=omask)
            tl.store(ml_ptr + row * 2, m_i, mask=hm)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)
            tl.debug_barrier()                                                    # this program's stores issued
            slot = n * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel") == live - 1:
                tl.store(cnt_ptr + slot, 0)                                       # ready for the next launch
                _merge(ws_ptr, ml_ptr, out_ptr, n, heads, hm, r, omask, s_on, s_oh, H, live, BLOCK_R, SPLITS,
                       DYNAMIC_LOOP)
    else:                                                 # ws [N, S, H, BLOCK_R], ml [N, S, H, 2] fp32
        row = (n * SPLITS + split) * H + heads
        # a split with no key writes only m = -inf: the combine skips its partial sums
        has_keys = (tl.zeros([BLOCK_H], tl.int32) + t1) > t0                      # [BH], one value
        tl.store(ws_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=omask & has_keys[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=hm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)


@triton.jit
def _finish(acc, l_i, out_ptrs, omask):
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                              # kv_len 0: zeros
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(ws_ptr, ml_ptr, out_ptr, s_on, s_oh, H, R,
                    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SPLITS: tl.constexpr):
    # one program per (row, head block, BLOCK_C columns)
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    r = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    _merge(ws_ptr, ml_ptr, out_ptr, n, heads, hm, r, hm[:, None] & (r < R)[None, :], s_on, s_oh, H, SPLITS, BLOCK_R,
           SPLITS)


@triton.jit
def _merge(ws_ptr, ml_ptr, out_ptr, n, heads, hm, r, omask, s_on, s_oh, H, live, BLOCK_R: tl.constexpr,
           SPLITS, DYNAMIC: tl.constexpr = False):
    # out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s over the first `live` splits (splits
    # with no key: m_s = -inf, their partial sums neither read nor added), over columns r of row n's heads, in a
    # fixed order; DYNAMIC (compiled): a loop of `live` steps, else of SPLITS, the rest masked (the same sums);
    # read past L1 (.cg): merged inside the attention kernel, other programs of the same launch wrote them
    m = tl.full(heads.shape, float("-inf"), tl.float32)
    if DYNAMIC:
        for s in range(live):
            m = _split_max(m, ml_ptr, n, s, heads, hm, live, H, SPLITS)
    else:
        for s in range(SPLITS):
            m = _split_max(m, ml_ptr, n, s, heads, hm, live, H, SPLITS)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([heads.shape[0], r.shape[0]], tl.float32)
    l = tl.zeros(heads.shape, tl.float32)
    if DYNAMIC:
        for s in range(live):
            acc, l = _split_add(acc, l, m, ws_ptr, ml_ptr, n, s, heads, hm, r, omask, live, H, BLOCK_R, SPLITS)
    else:
        for s in range(SPLITS):
            acc, l = _split_add(acc, l, m, ws_ptr, ml_ptr, n, s, heads, hm, r, omask, live, H, BLOCK_R, SPLITS)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + n * s_on + heads[:, None] * s_oh + r[None, :], out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _split_max(m, ml_ptr, n, s, heads, hm, live, H, SPLITS):
    mine = hm & (heads * 0 + s < live)                                            # [BH], one value
    return tl.maximum(m, tl.load(ml_ptr + ((n * SPLITS + s) * H + heads) * 2, mask=mine, other=float("-inf"),
                                 cache_modifier=".cg"))


@triton.jit
def _split_add(acc, l, m, ws_ptr, ml_ptr, n, s, heads, hm, r, omask, live, H, BLOCK_R: tl.constexpr, SPLITS):
    row = (n * SPLITS + s) * H + heads
    mine = hm & (heads * 0 + s < live)
    ms = tl.load(ml_ptr + row * 2, mask=mine, other=float("-inf"), cache_modifier=".cg")
    w = tl.exp2(ms - m)
    l += w * tl.load(ml_ptr + row * 2 + 1, mask=mine, other=0.0, cache_modifier=".cg")
    keys = ms > float("-inf")                                                     # the split saw a key
    acc += w[:, None] * tl.load(ws_ptr + row[:, None] * BLOCK_R + r[None, :], mask=omask & keys[:, None],
                                other=0.0, cache_modifier=".cg")
    return acc, l


SPLITS_MAX, SPLIT_TILES_MIN = 16, 2     # a row's keys: at most 16 splits, each at least 2 key tiles


def num_splits(max_context: int, block_n: int) -> int:
    """The grid's key splits per (row, head block): enough for every row of up to max_context keys.

    A row of L keys (L / block_n tiles) is cut into splits of max(cdiv(tiles, SPLITS_MAX), SPLIT_TILES_MIN)
    tiles: from L alone, never from the batch, so a row gets the same bits in a decode of one row and in a
    verify of 128 (fp32 partial sums merged in another grouping differ in the last bits, and a greedy near-tie
    could then go the other way: BENCHMARKS.md "Lossless at any batch"). Splits past a row's keys exit."""
    return max(1, min(SPLITS_MAX, triton.cdiv(triton.cdiv(max_context, block_n), SPLIT_TILES_MIN)))


def mla_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                         block_tables: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, max_context: int | None = None,
                         out: torch.Tensor | None = None, splits: int | None = None,
                         block_n: int | None = None, num_warps: int | None = None,
                         arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [N, h, R], q_pe [N, h, P], ckv [blocks, block_size, R], kpe [blocks, block_size, P],
    block_tables [B, max_blocks] int32, token_request [N], positions [N], context_lens [B] -> [N, h, R].

    max_context bounds the keys a row may see (default: the table's capacity); it sizes the key splits
    and is the interpreter's loop bound. `out` may be a static buffer (CUDA graphs). `arrivals`: int32 zeros, at
    least N * cdiv(h, BLOCK_H) of them (models/kv_cache.PagedKVCache.arrivals; left zero after each launch; one
    stream at a time): the splits are merged by the last of them to arrive, in the same launch and the same
    order as `_combine_kernel` (same bits), one launch instead of two."""
    N, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert ckv.stride(-1) == 1 and kpe.stride(-1) == 1 and q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1
    if out is None:
        out = torch.empty(N, H, R, dtype=q_lat.dtype, device=q_lat.device)
    if N == 0 or H == 0:
        return out
    block_size = ckv.shape[1]
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    block_r = triton.next_power_of_2(R)
    block_n = block_n or max(16, min(64, 65536 // (block_r * q_lat.element_size())))   # key tile <= 64 KB
    block_h = 16 if H <= 16 or block_r * q_lat.element_size() > 1024 else 32
    per_min = 1 if splits else SPLIT_TILES_MIN     # splits given: the old rule (tests); else num_splits's
    splits = splits or num_splits(max_context, block_n)
    ws = torch.empty(N * splits * H * block_r if splits > 1 else 1, dtype=torch.float32, device=q_lat.device)
    ml = torch.empty(N * splits * H * 2 if splits > 1 else 1, dtype=torch.float32, device=q_lat.device)
    grid = (N, triton.cdiv(H, block_h), splits)
    merge = splits > 1 and arrivals is not None and arrivals.numel() >= N * grid[1]
    _mla_kernel[grid](q_lat, q_pe, ckv, kpe, block_tables, token_request, positions, context_lens, out, ws, ml,
                      q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0),
                      ckv.stride(1), kpe.stride(0), kpe.stride(1), block_tables.stride(0), out.stride(0),
                      out.stride(1), H, R, P, block_size, scale * LOG2E, splits,
                      BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(P)),
                      PER_MIN=per_min,
                      KV_TILES=0 if q_lat.is_cuda else triton.cdiv(max_context, block_n),
                      DYNAMIC_LOOP=q_lat.is_cuda, PRECISION=dot_precision(q_lat), cnt_ptr=arrivals if merge else None,
                      MERGE=merge, num_warps=num_warps or (8 if block_r >= 256 else 4), num_stages=2)
    if splits > 1 and not merge:
        combine_splits(ws, ml, out, block_h, block_r, splits)
    return out


def combine_splits(ws: torch.Tensor, ml: torch.Tensor, out: torch.Tensor, block_h: int, block_r: int,
                   splits: int) -> None:
    """Merge the key splits' partial (acc, max, sum) of a split attention kernel into out [N, h, R]."""
    N, H, R = out.shape
    block_c = min(block_r, 128)
    _combine_kernel[(N, triton.cdiv(H, block_h), block_r // block_c)](
        ws, ml, out, out.stride(0), out.stride(1), H, R, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_C=block_c,
        SPLITS=splits, num_warps=4)
