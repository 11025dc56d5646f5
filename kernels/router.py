"""PyTorch reference of DeepSeek's expert choice from router logits (the model's MoE router, models/moe.py):

    scores = sigmoid(logits) (V3, V3.2) or softmax(logits) (V2)
    choice = scores + e_score_correction_bias                      (noaux_tc; without it: scores)
    groups (n_group > 1): a group scores the sum of its top-2 choices (noaux_tc) or its max; only the
        topk_group best groups stay eligible
    ids    = the top_k choices, best first (the bias selects, never weighs)
    weights = scores[ids], normalized to sum 1 (norm_topk_prob, top_k > 1), times routed_scaling_factor
The Triton version (kernels/triton_router.py) does it in one launch per batch; kernels/dispatch.py picks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rows import vector_ready


@dataclass(frozen=True)
class RouteSpec:
    sigmoid: bool
    n_group: int
    topk_group: int
    top_k: int
    noaux: bool                 # group score: top-2 sum (noaux_tc) or max
    norm: bool
    scale: float


def select(logits: torch.Tensor, bias: torch.Tensor | None, spec: RouteSpec) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [N, E] fp32, bias: [E] (fp32, or promoted to it) or None -> weights [N, top_k] fp32, ids [N, top_k] int64
    n = logits.shape[0]
    logits = vector_ready(logits)        # CPU: rows of whole vectors, each row's sigmoid bits its own (kernels/rows.py)
    scores = logits.sigmoid() if spec.sigmoid else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    if spec.n_group > 1:
        grouped = choice.view(-1, spec.n_group, choice.shape[-1] // spec.n_group)
        group_score = grouped.topk(2, -1)[0].sum(-1) if spec.noaux else grouped.amax(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(spec.topk_group, -1)[1], 1.0)
        choice = grouped.masked_fill(keep[..., None] == 0, float("-inf")).flatten(1)
    ids = choice.topk(spec.top_k, -1)[1]
    weights = scores.gather(1, ids)
    if spec.norm and spec.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * spec.scale)[:n], ids[:n]
