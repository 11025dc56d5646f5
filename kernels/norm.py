"""PyTorch references of the per-token elementwise layers: RMSNorm and rotary position embedding (RoPE).

    rms_norm(x, w)   = w * (x / sqrt(mean(x^2) + eps)), normalized in fp32, cast to x's dtype, then scaled
    add_rms_norm(x, r, w) = (s, rms_norm(s, w)) with s = x + r in x's dtype (a residual add and the next norm)
    silu_mul(gu)     = silu(g) * u for gu = [g | u] (a SwiGLU's gate and up halves side by side)
    rotary(x, pos)   : each pair (x_a, x_b) of the rope dims turns by pos * inv_freq[i], times attention_factor;
                       pairs are (x_2i, x_2i+1) when interleaved (DeepSeek's MLA layout), (x_i, x_i+R/2) else
Triton versions (kernels/triton_norm.py) do each in one launch; kernels/dispatch.py picks.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], weight: [D] -> [..., D] in x's dtype
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    # x, r: [..., D] -> (s = x + r, rms_norm(s)), both [..., D]
    s = x + r
    return s, rms_norm(s, weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    # gu: [..., 2P] (gate | up) -> [..., P]
    g, u = gu.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float,
           interleave: bool) -> torch.Tensor:
    # x: [N, H, R] rope part, positions: [N], inv_freq: [R/2] fp32 -> [N, H, R] in x's dtype
    freqs = positions.float()[:, None] * inv_freq[None, :]                  # [N, R/2]
    cos = (freqs.cos() * factor)[:, None, :]
    sin = (freqs.sin() * factor)[:, None, :]
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, -1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)
    return out.to(x.dtype)
