"""Flash-style causal MLA prefill in Triton (issue 17): tiles of query rows against tiles of the paged latent
cache, in the absorbed form of kernels/triton_mla.py.

A program takes one tile of up to BLOCK_M consecutive query rows of ONE request and BLOCK_H heads: its
BLOCK_M x BLOCK_H query vectors are the M = 64 rows of one [M, R] operand, which meets every key tile
[BLOCK_N, R] of the request's cache up to the causal limit of the tile's last row. Each key tile is read
once per 64 query vectors (the per-row kernel: once per BLOCK_H = 16) and the products are 64 rows tall,
the tensor cores' tile. Row n of request b at position pos sees keys j < min(pos + 1, context_lens[b])
(fp32 online softmax, kernels/triton_mla.paged_softmax_step, with a per-row causal mask on the last tiles).

Chunked prefill and prefix hits need nothing more: a request's rows are its last query_len positions,
their keys before `start` already in the cache. Mixed batches: the tile table (`plan_tiles`, host, once
per step) lists each tile's (first row, end row) over all requests, longest contexts first so the long
programs start first. It reads host metadata: the eager prefill path only (kernels/dispatch.prefill_form),
never inside a CUDA graph. On CUDA the launch is autotuned (key tile, warps, stages) once per head / rank
shape; under TRITON_INTERPRET=1 (tests) a fixed configuration runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot_precision
from kernels.triton_mla import LOG2E, paged_softmax_step

QUERY_VECTORS = 64          # BLOCK_M x BLOCK_H: the rows of one program's products


@triton.jit
def _prefill_kernel(ql_ptr, qp_ptr, ckv_ptr, kpe_ptr, bt_ptr, req_ptr, pos_ptr, clen_ptr, tile_ptr, out_ptr,
                    s_qln, s_qlh, s_qpn, s_qph, s_cb, s_cs, s_kb, s_ks, s_bt, s_on, s_oh,
                    H, R, P, block_size, scale_log2,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_P: tl.constexpr, KV_TILES: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
                    PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    n0 = tl.load(tile_ptr + 2 * tile).to(tl.int64)                               # rows [n0, n1): one request
    n1 = tl.load(tile_ptr + 2 * tile + 1).to(tl.int64)
    i = tl.arange(0, BLOCK_M * BLOCK_H)
    n = n0 + i // BLOCK_H                                                         # [MH] query row
    heads = tl.program_id(1) * BLOCK_H + i % BLOCK_H                              # [MH] its head
    live = (n < n1) & (heads < H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    rm, pm = r < R, p < P
    b = tl.load(req_ptr + n0).to(tl.int64)
    clen = tl.load(clen_ptr + b)
    kv_len = tl.minimum(tl.load(pos_ptr + n, mask=live, other=-1).to(tl.int32) + 1, clen)   # [MH], 0 if dead
    hi = tl.minimum(tl.load(pos_ptr + n1 - 1).to(tl.int32) + 1, clen)             # keys the last row sees
    q = tl.load(ql_ptr + n[:, None] * s_qln + heads[:, None] * s_qlh + r[None, :], mask=live[:, None] & rm[None, :],
                other=0.0)                                                        # [MH, BR]
    qp = tl.load(qp_ptr + n[:, None] * s_qpn + heads[:, None] * s_qph + p[None, :],
                 mask=live[:, None] & pm[None, :], other=0.0)                     # [MH, BP]
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], tl.float32)
    # compiled: loop to the tile's own causal limit; interpreted: to KV_TILES (a host constant: the
    # interpreter loops to constexpr bounds), the keys past `hi` masked out
    if DYNAMIC_LOOP:
        for t in range(0, tl.cdiv(hi, BLOCK_N)):
            j = t * BLOCK_N + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = paged_softmax_step(j, j < hi, j[None, :] < kv_len[:, None], q, qp, m_i, l_i, acc,
                                               ckv_ptr, kpe_ptr, bt_ptr, b, s_cb, s_cs, s_kb, s_ks, s_bt,
                                               block_size, scale_log2, r, p, rm, pm, PRECISION)
    else:
        for t in range(KV_TILES):
            j = t * BLOCK_N + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = paged_softmax_step(j, j < hi, j[None, :] < kv_len[:, None], q, qp, m_i, l_i, acc,
                                               ckv_ptr, kpe_ptr, bt_ptr, b, s_cb, s_cs, s_kb, s_ks, s_bt,
                                               block_size, scale_log2, r, p, rm, pm, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                              # a row with no key: zeros
    tl.store(out_ptr + n[:, None] * s_on + heads[:, None] * s_oh + r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & rm[None, :])


# CUDA: the key tile and pipeline stages are measured once per (H, R, P) on the first call (a config that does
# not fit the shared memory is skipped by the autotuner). 8 warps: the [64, 512] fp32 accumulator is 128
# registers a thread (4 warps spill it); at R = 512 the key tiles of 64 with 2 stages take 216 KB of shared memory
CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=8, num_stages=s) for bn, s in ((32, 2), (64, 2), (32, 3), (64, 1))]
_tuned = triton.autotune(CONFIGS, key=["H", "R", "P"])(_prefill_kernel)


def block_sizes(heads: int) -> tuple[int, int]:
    """(BLOCK_M query rows, BLOCK_H heads) of a program: 64 query vectors, heads first (at most 16)."""
    block_h = min(16, triton.next_power_of_2(heads))
    return max(1, QUERY_VECTORS // block_h), block_h


def plan_tiles(query_lens: list[int], starts: list[int], block_m: int) -> torch.Tensor:
    """[T, 2] int32 (first row, end row) of every tile of <= block_m consecutive rows of one request over
    the step's flattened rows (request-major), the tiles whose last row sees the most keys first."""
    tiles, row = [], 0
    for s, n in zip(starts, query_lens):
        for a in range(0, n, block_m):
            e = min(a + block_m, n)
            tiles.append((s + e, row + a, row + e))
        row += n
    tiles.sort(key=lambda t: -t[0])
    return torch.tensor([[a, e] for _, a, e in tiles], dtype=torch.int32).view(-1, 2)


def mla_prefill_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                       block_tables: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                       context_lens: torch.Tensor, tiles: torch.Tensor, scale: float, max_context: int,
                       block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """q_lat [N, h, R], q_pe [N, h, P], ckv [blocks, block_size, R], kpe [blocks, block_size, P],
    block_tables [B, max_blocks] int32, token_request [N], positions [N], context_lens [B], tiles [T, 2]
    (plan_tiles with block_sizes(h)[0], on the device) -> [N, h, R].

    max_context: the most keys a row sees (the interpreter's loop bound). block_n / num_warps fix the launch
    (default: autotuned on CUDA, 16 / 4 interpreted)."""
    N, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert ckv.stride(-1) == 1 and kpe.stride(-1) == 1 and q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1
    out = torch.empty(N, H, R, dtype=q_lat.dtype, device=q_lat.device)
    if N == 0 or H == 0:
        return out
    block_m, block_h = block_sizes(H)
    block_r = triton.next_power_of_2(R)
    grid = (tiles.shape[0], triton.cdiv(H, block_h))
    args = (q_lat, q_pe, ckv, kpe, block_tables, token_request, positions, context_lens, tiles, out,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0), ckv.stride(1),
            kpe.stride(0), kpe.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
            H, R, P, ckv.shape[1], scale * LOG2E)
    consts = dict(BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(P)),
                  PRECISION=dot_precision(q_lat), DYNAMIC_LOOP=q_lat.is_cuda)
    if q_lat.is_cuda and block_n is None:
        _tuned[grid](*args, KV_TILES=0, **consts)
    else:
        bn = block_n or 16
        _prefill_kernel[grid](*args, BLOCK_N=bn, KV_TILES=0 if q_lat.is_cuda else triton.cdiv(max_context, bn),
                              **consts, num_warps=num_warps or 4, num_stages=2)
    return out
