"""The router in Triton: its logits, and DeepSeek's expert choice (kernels/router.py), a launch each.

`logits`: x [N, D] . w [E, D] in fp32 (DeepSeek routes in fp32), each row's sums in one fixed order whatever N
is, so a token routes the same alone (decode) and among 128 rows (verify): cuBLAS's fp32 GEMM picks its kernel
by row count and then changes a row's last bits (BENCHMARKS.md "Lossless"). One program a row and two experts:
on an H200 1.8 us at one row of V2-Lite's shape (64 x 2048) and 3.1 us at V3's (256 x 7168), where cuBLAS
padded to 128 rows took 13.9 and 32.4 us; at 128 rows 6.7 / 51 us against 13.5 / 33 (BENCHMARKS.md).

`select`: one program per token over its E
logits (E and the group size powers of two; dispatch falls back to the reference otherwise). Eager, the
choice is a dozen small kernels a layer (sigmoid, bias add, two top-k, gather, sum, divide, scale, ...).
Top-k by repeated argmax: the same picks as torch.topk, best first (ties, which random fp32 scores do not
produce, go to the lower expert id). Runs compiled on CUDA tensors, or under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.router import RouteSpec


@triton.jit
def _route_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, s_l, scale, E: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  NOAUX: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    x = tl.load(logit_ptr + n * s_l + e).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e).to(tl.float32)
    if N_GROUP > 1:
        GS: tl.constexpr = E // N_GROUP
        g = tl.reshape(choice, (N_GROUP, GS))
        col = tl.arange(0, GS)[None, :]
        first = tl.argmax(g, 1)
        gscore = tl.max(g, 1)
        if NOAUX:                                                   # top-2 sum
            gscore += tl.max(tl.where(col == first[:, None], float("-inf"), g), 1)
        grp = tl.arange(0, N_GROUP)
        keep = grp < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(tl.where(keep, float("-inf"), gscore), 0)
            keep = keep | (grp == best)
        choice = tl.reshape(tl.where(keep[:, None], g, float("-inf")), (E,))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    ws = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0)
        ids = tl.where(k == i, best.to(tl.int64), ids)
        ws = tl.where(k == i, tl.sum(tl.where(e == best, scores, 0.0), 0), ws)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        if TOP_K > 1:
            ws = ws / (tl.sum(ws, 0) + 1e-20)
    tl.store(w_ptr + n * TOP_K + k, ws * scale, mask=k < TOP_K)
    tl.store(id_ptr + n * TOP_K + k, ids, mask=k < TOP_K)


@triton.jit
def _logits_kernel(x_ptr, w_ptr, out_ptr, E, D, s_x, s_w, s_o, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: one row x BLOCK_E experts; fp32 products kept per column lane over D, summed once at the end
    n = tl.program_id(0).to(tl.int64)
    ex = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.arange(0, BLOCK_D)
    em = ex < E
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dm = d0 + d < D
        x = tl.load(x_ptr + n * s_x + d0 + d, mask=dm, other=0.0).to(tl.float32)               # [BD]
        w = tl.load(w_ptr + ex[:, None] * s_w + d0 + d[None, :], mask=em[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)                                                  # [BE, BD]
        acc += x[None, :] * w
    tl.store(out_ptr + n * s_o + ex, tl.sum(acc, axis=1), mask=em)


LOGIT_TILE = (2, 1024)             # experts, columns a step: from the shape only (a row's bits: its own)


def logits(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int] = LOGIT_TILE) -> torch.Tensor:
    """x [N, D] (bf16 / fp32), w [E, D] -> [N, E] fp32 logits, each row computed alone."""
    x, w = x.contiguous(), w.contiguous()
    (N, D), E = x.shape, w.shape[0]
    out = torch.empty(N, E, dtype=torch.float32, device=x.device)
    be, bd = tile
    if N:
        _logits_kernel[(N, triton.cdiv(E, be))](x, w, out, E, D, x.stride(0), w.stride(0), out.stride(0),
                                                BLOCK_E=be, BLOCK_D=bd, num_warps=4)
    return out


def supported(E: int, spec: RouteSpec) -> bool:
    pow2 = lambda v: v > 0 and v & (v - 1) == 0
    return pow2(E) and pow2(spec.n_group) and E // spec.n_group >= 2 and spec.top_k <= E


def select(logits: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = logits.shape
    logits = logits.contiguous()
    w = torch.empty(N, spec.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(N, spec.top_k, dtype=torch.int64, device=logits.device)
    if N:
        _route_kernel[(N,)](logits, bias if bias is not None else logits, w, ids, logits.stride(0), spec.scale,
                            E=E, SIGMOID=spec.sigmoid, HAS_BIAS=bias is not None, N_GROUP=spec.n_group,
                            TOPK_GROUP=spec.topk_group, TOP_K=spec.top_k, NOAUX=spec.noaux, NORM=spec.norm,
                            BLOCK_K=triton.next_power_of_2(spec.top_k),
                            num_warps=1 if E <= 64 else 4)
    return w, ids
