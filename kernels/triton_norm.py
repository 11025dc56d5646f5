"""RMSNorm and rotary embedding in one Triton launch each (references: kernels/norm.py).

An eager RMSNorm is eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale) and an eager
rotary about fifteen; a DeepSeek layer runs three or four norms and two rotaries, so at batch 1 these tiny
launches cost more than the layer's attention (tandem bench profile on the H200). One program per row:
  _rms_norm_kernel   grid (rows,): x [rows, D] -> out [rows, D]
  _rotary_kernel     grid (N, H): x [N, H, R] -> out [N, H, R], angles from the position and inv_freq
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_x, s_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + row * s_x + d, mask=m, other=0.0).to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = w * xn.to(x_ptr.dtype.element_ty).to(tl.float32)                      # as the reference: cast, then scale
    tl.store(out_ptr + row * s_o + d, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), shape[-1], eps,
                                         BLOCK=triton.next_power_of_2(shape[-1]), num_warps=4)
    return out.view(shape)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, f_ptr, out_ptr, s_xn, s_xh, s_on, s_oh, factor, HALF,
                   BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    ang = tl.load(pos_ptr + n).to(tl.float32) * tl.load(f_ptr + i, mask=m, other=0.0)
    cos, sin = tl.cos(ang) * factor, tl.sin(ang) * factor
    if INTERLEAVE:
        a, b = 2 * i, 2 * i + 1
    else:
        a, b = i, i + HALF
    xa = tl.load(x_ptr + n * s_xn + h * s_xh + a, mask=m, other=0.0).to(tl.float32)
    xb = tl.load(x_ptr + n * s_xn + h * s_xh + b, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + n * s_on + h * s_oh + a, (xa * cos - xb * sin).to(dt), mask=m)
    tl.store(out_ptr + n * s_on + h * s_oh + b, (xa * sin + xb * cos).to(dt), mask=m)


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float,
           interleave: bool) -> torch.Tensor:
    N, H, R = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(N, H, R, dtype=x.dtype, device=x.device)
    if N and H:
        _rotary_kernel[(N, H)](x, positions, inv_freq, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                               factor, R // 2, BLOCK=triton.next_power_of_2(R // 2), INTERLEAVE=interleave,
                               num_warps=1)
    return out
