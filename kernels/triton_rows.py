"""Triton kernels that move hidden rows: MTP input preparation and the SP pad / shard / trim copies.

Same semantics and outputs as kernels/rows.py (the reference they are tested against). Each program
copies one [BLOCK_R, BLOCK_D] tile; the grid covers rows x columns, so there are no loops (and no
runtime loop bounds, which the interpreter cannot take). The `out=` variants write into a given
buffer (a persistent reduce-scatter input, a CUDA-graph static buffer) instead of allocating.

Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rows import mtp_offsets

BLOCK_R = 16
BLOCK_D = 256


@triton.jit
def _mtp_inputs_kernel(tok_ptr, hid_ptr, start_ptr, nrows_ptr, next_ptr, off_ptr, ids_ptr, rows_ptr,
                       s_hn, s_hd, s_rn, s_rd, D,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)                             # request
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)        # rows of this request
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(start_ptr + b).to(tl.int64)
    n = tl.load(nrows_ptr + b)
    o = tl.load(off_ptr + b)                                      # first output row of request b
    keep = i < n
    src = start + i                                               # row in the run
    if tl.program_id(2) == 0:                                     # ids once per row, not per column block
        after = tl.load(tok_ptr + src + 1, mask=keep & (i + 1 < n), other=0)
        nxt = tl.load(next_ptr + b)
        tl.store(ids_ptr + o + i, tl.where(i + 1 < n, after, nxt.to(after.dtype)), mask=keep)
    m = keep[:, None] & (cols < D)[None, :]
    x = tl.load(hid_ptr + src[:, None] * s_hn + cols[None, :] * s_hd, mask=m)
    tl.store(rows_ptr + (o + i)[:, None] * s_rn + cols[None, :] * s_rd, x, mask=m)


def prepare_mtp_inputs_triton(tokens: torch.Tensor, hidden: torch.Tensor, starts: torch.Tensor,
                              num_rows: torch.Tensor, next_tokens: torch.Tensor,
                              total_rows: int | None = None, max_rows: int | None = None):
    """tokens [N], hidden [N, D], starts [B], num_rows [B], next_tokens [B] -> input_ids [R], rows [R, D]
    (kernels.rows.prepare_mtp_inputs). total_rows = sum(num_rows) and max_rows >= max(num_rows) size the
    output and the grid; pass them when known on the host (verify: max_rows = K + 1), else they are read
    back from the device (a sync)."""
    dev = hidden.device
    starts, num_rows, next_tokens = starts.to(dev), num_rows.to(dev), next_tokens.to(dev)
    tokens = tokens.to(dev)
    B, D = num_rows.shape[0], hidden.shape[1]
    if total_rows is None:
        total_rows = int(num_rows.sum()) if B else 0
    if max_rows is None:
        max_rows = int(num_rows.max()) if B else 0
    input_ids = torch.empty(total_rows, dtype=tokens.dtype, device=dev)
    rows = torch.empty(total_rows, D, dtype=hidden.dtype, device=dev)
    if total_rows and max_rows and D:
        grid = (B, triton.cdiv(max_rows, BLOCK_R), triton.cdiv(D, BLOCK_D))
        _mtp_inputs_kernel[grid](tokens, hidden, starts, num_rows, next_tokens, mtp_offsets(num_rows),
                                 input_ids, rows, *hidden.stride(), *rows.stride(), D,
                                 BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return input_ids, rows


@triton.jit
def _row_window_kernel(x_ptr, out_ptr, first, n_src, n_out, s_xn, s_xd, s_on, s_od, D,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # out[j] = x[first + j] if first + j < n_src else 0, for j in [0, n_out)
    j = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    src = first + j
    inside = (j < n_out)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + src[:, None] * s_xn + cols[None, :] * s_xd, mask=inside & (src < n_src)[:, None],
                other=0.0)
    tl.store(out_ptr + j[:, None] * s_on + cols[None, :] * s_od, x, mask=inside)


def _window(x: torch.Tensor, first: int, n_src: int, n_out: int, out: torch.Tensor | None) -> torch.Tensor:
    # x: [N, D] -> out [n_out, D]; rows of x past n_src read as zeros
    D = x.shape[1]
    if out is None:
        out = torch.empty(n_out, D, dtype=x.dtype, device=x.device)
    assert out.shape == (n_out, D) and out.dtype == x.dtype, (tuple(out.shape), n_out, D, out.dtype)
    if n_out and D:
        grid = (triton.cdiv(n_out, BLOCK_R), triton.cdiv(D, BLOCK_D))
        _row_window_kernel[grid](x, out, first, n_src, n_out, *x.stride(), *out.stride(), D,
                                 BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return out


def pad_rows_triton(x: torch.Tensor, multiple: int, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, D] -> [ceil(N / multiple) * multiple, D], zero rows appended (kernels.rows.pad_rows; always a copy)
    n = x.shape[0]
    return _window(x, 0, n, n + (-n % multiple), out)


def pad_shard_rows_triton(x: torch.Tensor, tp: int, rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, D] -> rank's [S, D] of pad_rows(x, tp), S = ceil(N / tp), without building the padded copy
    n = x.shape[0]
    s = -(-n // tp)
    return _window(x, rank * s, n, s, out)


def trim_rows_triton(gathered: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    # gathered: [tp * S, D] all-gathered shards -> [n, D] (kernels.rows.trim_rows, as a contiguous copy)
    assert n <= gathered.shape[0], f"trim to {n} rows of {gathered.shape[0]}"
    return _window(gathered, 0, n, n, out)
