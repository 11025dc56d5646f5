"""Triton kernels that move hidden rows: the SP pad / shard / trim copies.

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

BLOCK_R = 16
BLOCK_D = 256


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
