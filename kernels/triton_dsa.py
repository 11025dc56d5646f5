"""DeepSeek sparse attention (DSA, V3.2) in Triton: the lightning indexer's scores and sparse MLA over the
paged caches, computing what the PyTorch references in kernels/dsa.py compute (its docstring is the spec).

index_scores_triton, for query row n of request b = token_request[n], kv_len = min(positions[n] + 1,
context_lens[b]), and key position j < width:
    score[n, j] = k_scale[slot(j)] * sum_h w[n, h] * relu(q[n, h] . k[slot(j)])    for j < kv_len, else -inf
slot(j) = block_tables[b, j // block_size] * block_size + j % block_size. One program per (row, tile of
BLOCK_N key positions): q[n] [H, D] is loaded once, the key tile [BLOCK_N, D] through the block table,
one tl.dot gives [H, BLOCK_N] fp32 dot products. A tile wholly past kv_len writes -inf and loads no key.
fp8 e4m3 q / k (deployed mode) go to Hopper's tensor cores as fp8, accumulating in fp32.

sparse_mla_triton: paged MLA in the absorbed form, as kernels/triton_mla.py, over only the keys whose
positions indices[n, :] lists (-1: no key); fp32 online softmax; a row with no key writes zeros. One
program per (query row, block of BLOCK_H heads, split of the index list); its key tiles are gathered:
slot t of the list is key pos = indices[n, t] at page block_tables[b, pos // block_size]. With S > 1
splits (decode: few rows, k = 2048 keys each) the splits' (acc, max, sum) go to triton_mla's fp32
workspace and `combine_splits` (kernels/triton_mla.py) merges them.

Grids, splits and constexprs come from shapes alone and nothing is read back to the host: both launch
inside a CUDA graph, into static `out` buffers if given. Runs compiled on CUDA tensors, or on CPU
tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_precision
from kernels.triton_mla import LOG2E, SPLIT_TILES_MIN, combine_splits, num_splits, paged_softmax_step


# --- indexer scores -----------------------------------------------------------------------------------------

@triton.jit
def _index_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, clen_ptr, out_ptr,
                  s_qn, s_qh, s_wn, s_kb, s_ks, s_sb, s_ss, s_bt, s_on, H, D, width, block_size,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    j = start + tl.arange(0, BLOCK_N)                                             # key positions [BN]
    b = tl.load(req_ptr + n).to(tl.int64)
    kv_len = tl.minimum(tl.load(pos_ptr + n).to(tl.int32) + 1, tl.load(clen_ptr + b))
    score = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if start < kv_len:                                                            # else: -inf, no key read
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hm, dm, jm = heads < H, d < D, j < kv_len
        q = tl.load(q_ptr + n * s_qn + heads[:, None] * s_qh + d[None, :], mask=hm[:, None] & dm[None, :],
                    other=0.0)                                                    # [BH, BD]
        page = tl.load(bt_ptr + b * s_bt + j // block_size, mask=jm, other=0).to(tl.int64)
        row = j % block_size
        k = tl.load(k_ptr + (page * s_kb + row * s_ks)[:, None] + d[None, :], mask=jm[:, None] & dm[None, :],
                    other=0.0).to(q.dtype)                                        # [BN, BD]
        s = tl.maximum(dot(q, tl.trans(k), PRECISION), 0.0)                       # [BH, BN] fp32, relu
        w = tl.load(w_ptr + n * s_wn + heads, mask=hm, other=0.0)                 # [BH]
        sc = tl.sum(s * w[:, None], 0)                                            # [BN]
        if HAS_SCALE:
            sc = sc * tl.load(ks_ptr + page * s_sb + row * s_ss, mask=jm, other=0.0)
        score = tl.where(jm, sc, float("-inf"))
    tl.store(out_ptr + n * s_on + j, score, mask=j < width)


def index_scores_triton(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                        block_tables: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                        context_lens: torch.Tensor, width: int, out: torch.Tensor | None = None,
                        block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """q [N, H, D] (fp32 / bf16, or fp8 e4m3), w [N, H] fp32, k_cache [blocks, block_size, D] (q's dtype:
    the key tile is cast to it), k_scale [blocks, block_size] fp32 or None, block_tables [B, max_blocks]
    int32, token_request [N] int32, positions [N] int64, context_lens [B] int32 -> scores [N, width] fp32,
    as kernels.dsa.index_scores. `out` may be a static [N, width] fp32 buffer (CUDA graphs)."""
    N, H, D = q.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and w.stride(-1) == 1
    if out is None:
        out = torch.empty(N, width, dtype=torch.float32, device=q.device)
    assert out.shape == (N, width) and out.dtype == torch.float32 and out.stride(-1) == 1
    if N == 0 or width == 0:
        return out
    block_n = block_n or (64 if q.is_cuda else 16)
    assert triton.cdiv(width, block_n) < 65536, "grid axis 1 holds at most 65535 key tiles"
    fp8 = q.dtype == torch.float8_e4m3fn
    block_d = max(32 if fp8 else 16, triton.next_power_of_2(D))                  # tl.dot's minimum K
    ks = k_scale if k_scale is not None else w                                    # any pointer when unused
    s_sb, s_ss = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    grid = (N, triton.cdiv(width, block_n))
    _index_kernel[grid](q, w, k_cache, ks, block_tables, token_request, positions, context_lens, out,
                        q.stride(0), q.stride(1), w.stride(0), k_cache.stride(0), k_cache.stride(1), s_sb, s_ss,
                        block_tables.stride(0), out.stride(0), H, D, width, k_cache.shape[1],
                        BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_N=block_n, BLOCK_D=block_d,
                        HAS_SCALE=k_scale is not None, PRECISION=dot_precision(q), num_warps=num_warps)
    return out


# --- sparse MLA ---------------------------------------------------------------------------------------------

@triton.jit
def _gathered_tile(t, q, qp, m_i, l_i, acc, idx_ptr, ckv_ptr, kpe_ptr, bt_ptr, n, b, K, s_in, s_cb, s_cs,
                   s_kb, s_ks, s_bt, block_size, scale_log2, r, p, rm, pm,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # one online-softmax step over the keys listed in indices[n, t * BLOCK_N : (t + 1) * BLOCK_N]
    i = t * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(idx_ptr + n * s_in + i, mask=i < K, other=-1)                   # [BN] key positions
    live = pos >= 0
    return paged_softmax_step(pos, live, live[None, :], q, qp, m_i, l_i, acc, ckv_ptr, kpe_ptr, bt_ptr, b, s_cb,
                              s_cs, s_kb, s_ks, s_bt, block_size, scale_log2, r, p, rm, pm, PRECISION)


@triton.jit
def _sparse_mla_kernel(ql_ptr, qp_ptr, ckv_ptr, kpe_ptr, bt_ptr, req_ptr, idx_ptr, out_ptr, ws_ptr, ml_ptr,
                       s_qln, s_qlh, s_qpn, s_qph, s_cb, s_cs, s_kb, s_ks, s_bt, s_in, s_on, s_oh,
                       H, R, P, K, block_size, scale_log2,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_P: tl.constexpr, SPLITS: tl.constexpr, PER_SPLIT: tl.constexpr,
                       DYNAMIC_LOOP: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hm = heads < H
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    rm, pm = r < R, p < P
    b = tl.load(req_ptr + n).to(tl.int64)
    t0 = split * PER_SPLIT                                                        # this split's first tile
    q = tl.load(ql_ptr + n * s_qln + heads[:, None] * s_qlh + r[None, :], mask=hm[:, None] & rm[None, :],
                other=0.0)                                                        # [BH, BR]
    qp = tl.load(qp_ptr + n * s_qpn + heads[:, None] * s_qph + p[None, :], mask=hm[:, None] & pm[None, :],
                 other=0.0)                                                       # [BH, BP]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # compiled: this split's tiles of the index list; interpreted: PER_SPLIT tiles (constexpr bound), those
    # past the list masked out (its slots t >= K read as -1)
    if DYNAMIC_LOOP:
        for t in range(t0, tl.minimum(t0 + PER_SPLIT, tl.cdiv(K, BLOCK_N))):
            m_i, l_i, acc = _gathered_tile(t, q, qp, m_i, l_i, acc, idx_ptr, ckv_ptr, kpe_ptr, bt_ptr, n, b, K,
                                           s_in, s_cb, s_cs, s_kb, s_ks, s_bt, block_size, scale_log2,
                                           r, p, rm, pm, BLOCK_N, PRECISION)
    else:
        for i in range(PER_SPLIT):
            m_i, l_i, acc = _gathered_tile(t0 + i, q, qp, m_i, l_i, acc, idx_ptr, ckv_ptr, kpe_ptr, bt_ptr, n,
                                           b, K, s_in, s_cb, s_cs, s_kb, s_ks, s_bt, block_size, scale_log2,
                                           r, p, rm, pm, BLOCK_N, PRECISION)
    omask = hm[:, None] & rm[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                          # no key: zeros
        tl.store(out_ptr + n * s_on + heads[:, None] * s_oh + r[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=omask)
    else:                                 # triton_mla's layout: ws [N, S, H, BLOCK_R], ml [N, S, H, 2] fp32
        row = (n * SPLITS + split) * H + heads
        tl.store(ws_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m_i, mask=hm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)


def sparse_mla_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                      block_tables: torch.Tensor, token_request: torch.Tensor, indices: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, splits: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """q_lat [N, h, R], q_pe [N, h, P], ckv [blocks, block_size, R], kpe [blocks, block_size, P],
    block_tables [B, max_blocks] int32, token_request [N] int32, indices [N, k] int32 (key positions of
    the row's request, -1: none) -> [N, h, R], as kernels.dsa.sparse_mla. `out` may be a static buffer;
    splits (of the index list) default to a cut that depends on k alone (triton_mla.num_splits)."""
    N, H, R = q_lat.shape
    P, K = q_pe.shape[-1], indices.shape[-1]
    assert ckv.stride(-1) == 1 and kpe.stride(-1) == 1 and q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1
    assert indices.stride(-1) == 1
    if out is None:
        out = torch.empty(N, H, R, dtype=q_lat.dtype, device=q_lat.device)
    if N == 0 or H == 0:
        return out
    if K == 0:
        return out.zero_()
    block_r = triton.next_power_of_2(R)
    block_n = block_n or max(16, min(64, 65536 // (block_r * q_lat.element_size())))   # key tile <= 64 KB
    block_h = 16 if H <= 16 or block_r * q_lat.element_size() > 1024 else 32
    per_min = 1 if splits else SPLIT_TILES_MIN       # the list's cut from K alone (triton_mla.num_splits)
    splits = splits or num_splits(K, block_n)
    per_split = max(triton.cdiv(triton.cdiv(K, block_n), splits), per_min)         # index tiles per split
    ws = torch.empty(N * splits * H * block_r if splits > 1 else 1, dtype=torch.float32, device=q_lat.device)
    ml = torch.empty(N * splits * H * 2 if splits > 1 else 1, dtype=torch.float32, device=q_lat.device)
    grid = (N, triton.cdiv(H, block_h), splits)
    _sparse_mla_kernel[grid](q_lat, q_pe, ckv, kpe, block_tables, token_request, indices, out, ws, ml,
                             q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0),
                             ckv.stride(1), kpe.stride(0), kpe.stride(1), block_tables.stride(0),
                             indices.stride(0), out.stride(0), out.stride(1), H, R, P, K, ckv.shape[1],
                             scale * LOG2E, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r,
                             BLOCK_P=max(16, triton.next_power_of_2(P)), SPLITS=splits, PER_SPLIT=per_split,
                             DYNAMIC_LOOP=q_lat.is_cuda, PRECISION=dot_precision(q_lat),
                             num_warps=num_warps or (8 if block_r >= 256 else 4), num_stages=2)
    if splits > 1:
        combine_splits(ws, ml, out, block_h, block_r, splits)
    return out
