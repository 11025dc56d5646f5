"""RMSNorm (with the residual add before it), SwiGLU's silu(gate) * up and rotary embedding in one Triton launch
each (references: kernels/norm.py).

An eager RMSNorm is eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale) and an eager
rotary about fifteen; a DeepSeek layer runs three or four norms and two rotaries, so at batch 1 these tiny
launches cost more than the layer's attention (tandem bench profile on the H200). One program per row:
  _rms_norm_kernel   grid (rows,): x [rows, D] (+ r [rows, D], kept as s) -> out [rows, D]
  _silu_mul_kernel   grid (rows, P / BLOCK): gu [rows, 2P] -> out [rows, P]
  _rotary_kernel     grid (N, H): x [N, H, R] -> out [N, H, R], angles from the position and inv_freq
Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, s_x, s_r, s_o, s_s, D, eps, BLOCK: tl.constexpr,
                     ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + row * s_x + d, mask=m, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    if ADD:                                                                     # s = x + r, rounded as torch's add
        dt = sum_ptr.dtype.element_ty
        x = (x + tl.load(r_ptr + row * s_r + d, mask=m, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * s_s + d, x, mask=m)
        x = x.to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = w * xn.to(dt).to(tl.float32)                                          # as the reference: cast, then scale
    tl.store(out_ptr + row * s_o + d, y.to(out_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def padded(rows: int, cols: int, pad: int, dtype, device) -> torch.Tensor:
    """[rows, cols] as the first rows of a [max(rows, pad), cols] buffer: a GEMM that runs every call of fewer
    than `pad` rows as `pad` rows (models/layers.dense_linear) takes it without a copy."""
    return torch.empty(max(rows, pad), cols, dtype=dtype, device=device)[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pad: int = 0):
    """RMSNorm(x) [..., D]; with `residual`: (s, RMSNorm(s)) for s = x + residual, one launch either way. pad:
    the outputs are the first rows of `pad`-row buffers (see padded)."""
    shape = x.shape
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    dt = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = padded(x2.shape[0], shape[-1], pad, torch.promote_types(dt, weight.dtype), x.device)
    s = padded(x2.shape[0], shape[-1], pad, dt, x.device) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, s, x2.stride(0), r2.stride(0), out.stride(0),
                                         s.stride(0), shape[-1], eps, BLOCK=triton.next_power_of_2(shape[-1]),
                                         ADD=residual is not None, num_warps=4)
    return (s.view(shape), out.view(shape)) if residual is not None else out.view(shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, s_g, s_o, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < P
    g = tl.load(gu_ptr + row * s_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_g + P + c, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)                         # silu rounds, then the product
    tl.store(out_ptr + row * s_o + c, (a * u).to(dt), mask=m)


def silu_mul(gu: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """gu [..., 2P] (gate | up) -> silu(gate) * up [..., P] in one launch; pad as rms_norm's."""
    g2 = _rows(gu)
    P = gu.shape[-1] // 2
    out = padded(g2.shape[0], P, pad, gu.dtype, gu.device)
    if g2.shape[0] and P:
        block = min(triton.next_power_of_2(P), 1024)
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(P, block))](g2, out, g2.stride(0), out.stride(0), P,
                                                               BLOCK=block, num_warps=4)
    return out.view(*gu.shape[:-1], P)


@triton.jit
def rope_pairs(pos_ptr, n, f_ptr, factor, HALF, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
    # row n's rope: (cos, sin [BLOCK] scaled by factor, pair indices a, b [BLOCK], mask [BLOCK]); also the MLA's
    # one-launch write (kernels/triton_mla_write.py), so both turn a vector to the same bits
    i = tl.arange(0, BLOCK)
    m = i < HALF
    ang = tl.load(pos_ptr + n).to(tl.float32) * tl.load(f_ptr + i, mask=m, other=0.0)
    cos, sin = tl.cos(ang) * factor, tl.sin(ang) * factor
    if INTERLEAVE:
        a, b = 2 * i, 2 * i + 1
    else:
        a, b = i, i + HALF
    return cos, sin, a, b, m


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, f_ptr, out_ptr, s_xn, s_xh, s_on, s_oh, factor, HALF,
                   BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cos, sin, a, b, m = rope_pairs(pos_ptr, n, f_ptr, factor, HALF, BLOCK, INTERLEAVE)
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
