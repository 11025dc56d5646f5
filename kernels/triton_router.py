"""DeepSeek's expert choice (kernels/router.py) in one Triton launch: one program per token over its E
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
