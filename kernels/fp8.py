"""DeepSeek's fp8 scheme, in PyTorch: the reference the Triton kernels (kernels/triton_fp8.py) are tested against,
and the path CPU serving runs.

Weights: fp8 e4m3 w [O, I] with one fp32 scale per 128x128 block, `weight_scale_inv` s [ceil(O/128), ceil(I/128)]
(the name DeepSeek's checkpoints use: the factor that dequantizes, w_real = w * s).
Activations: quantized on the fly per token per 128 columns, a_real = a_q * a_s, a_s [M, ceil(I/128)] =
amax / 448 of the group (448: e4m3's largest finite value).
    y[m, o] = sum_kb (a_q[m, kb] . w[o, kb]) * a_s[m, kb] * s[o // 128, kb]       (fp32)
The reference dequantizes both and multiplies in fp32; the kernels keep the fp8 products and promote each
128-wide block to fp32 with its two scales, the same sum in another order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.rows import gemm_ready

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                     # torch.finfo(torch.float8_e4m3fn).max
AMAX_MIN = 1e-12                    # an all-zero group keeps a finite scale (its values stay 0)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] (any float dtype, any device) -> (fp8 [O, I], weight_scale_inv [ceil(O/128), ceil(I/128)] fp32),
    as DeepSeek publishes V3: each block's amax maps to 448. Computed on w's device, one block row at a time
    (2048 rows in fp32 at a time), so a GPU weight never has a full fp32 twin."""
    O, I = w.shape
    q = torch.empty(O, I, dtype=FP8, device=w.device)
    s = torch.empty(blocks(O), blocks(I), dtype=torch.float32, device=w.device)
    step = 16 * BLOCK
    for r0 in range(0, O, step):
        rows = w[r0:r0 + step].float()                                            # [R, I]
        R, RB = rows.shape[0], blocks(rows.shape[0])
        t = F.pad(rows, (0, blocks(I) * BLOCK - I, 0, RB * BLOCK - R)).view(RB, BLOCK, blocks(I), BLOCK)
        sc = t.abs().amax((1, 3)).clamp(min=AMAX_MIN) / FP8_MAX                    # [RB, IB]
        s[r0 // BLOCK:r0 // BLOCK + RB] = sc
        q[r0:r0 + step] = (t / sc[:, None, :, None]).view(RB * BLOCK, -1)[:R, :I].to(FP8)
    return q, s


def dequantize_weight(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # w: [..., O, I] fp8, s: [..., ceil(O/128), ceil(I/128)] -> fp32 w * s per 128x128 block
    O, I = w.shape[-2:]
    full = s.float().repeat_interleave(BLOCK, -2)[..., :O, :].repeat_interleave(BLOCK, -1)[..., :I]
    return w.float() * full


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scales [M, ceil(K/128)] fp32): per token per 128 columns, amax -> 448."""
    M, K = x.shape
    pad = blocks(K) * BLOCK - K
    t = F.pad(x.float(), (0, pad)).view(M, blocks(K), BLOCK)                       # [M, KB, 128]
    s = t.abs().amax(-1).clamp(min=AMAX_MIN) / FP8_MAX                              # [M, KB]
    q = (t / s[..., None]).view(M, -1)[:, :K].to(FP8)
    return q, s


def dequantize_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # q: [M, K] fp8, s: [M, ceil(K/128)] -> fp32
    return q.float() * s.repeat_interleave(BLOCK, -1)[:, : q.shape[1]]


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., K] (fp32 / bf16 / fp16), w [N, K] fp8, s [ceil(N/128), ceil(K/128)] -> [..., N] in x's dtype:
    x quantized per token per 128 columns, both dequantized, one fp32 matmul."""
    shape = x.shape
    q, qs = quantize_act(x.reshape(-1, shape[-1]))
    y = gemm_ready(dequantize_act(q, qs)) @ dequantize_weight(w, s).t()              # [M, N] fp32
    return y[:q.shape[0]].to(x.dtype).view(*shape[:-1], w.shape[0])


def fp8_mlp(x: torch.Tensor, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """SwiGLU MLP of fp8 (weight, scale) pairs, as the fused kernel rounds it: gate and up in fp32, h = silu(gate)
    * up rounded to x's dtype, then quantized again for down. x [M, D] -> [M, D]."""
    q, qs = quantize_act(x)
    a = gemm_ready(dequantize_act(q, qs))                                            # [M, D] fp32
    g, u = a @ dequantize_weight(*gate).t(), a @ dequantize_weight(*up).t()          # [M, I]
    h = (F.silu(g) * u)[:x.shape[0]].to(x.dtype)
    return fp8_linear(h, *down)


def fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, first: int) -> torch.Tensor:
    """Reference of kernels/triton_fp8_moe.py: x [N, D], w13 [E, 2I, D] fp8 with s13 [E, 2 ceil(I/128), ceil(D/128)]
    (gate blocks, then up blocks), w2 [E, D, I] fp8 with s2 [E, ceil(D/128), ceil(I/128)], weights [N, k] fp32,
    ids [N, k] global expert ids -> [N, D] in x's dtype (this rank's experts only)."""
    I, IB = w2.shape[-1], blocks(w2.shape[-1])
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e + first).nonzero(as_tuple=True)
        if tok.numel():
            out = fp8_mlp(x[tok], (w13[e, :I], s13[e, :IB]), (w13[e, I:], s13[e, IB:]), (w2[e], s2[e]))
            y.index_add_(0, tok, out.float() * weights[tok, slot, None].float())
    return y.to(x.dtype)
