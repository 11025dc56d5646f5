"""Paged MLA attention in the absorbed form, the PyTorch reference (kernels/triton_mla.py and the FlashInfer
adapter compute the same on CUDA). `batch` is a models.kv_cache.AttentionBatch: its reference layout
(context_slots [B, Lmax], query_pad_index [N], mask [B, Tmax, Lmax]) is built from the host copy on first use."""
from __future__ import annotations

import torch


def latent_attention(q_lat, q_pe, batch, ckv, kpe, scale: float) -> torch.Tensor:
    """Reference attention over the latent cache. q_lat: [N, h, R], q_pe: [N, h, P] -> [N, h, R]."""
    B, Tmax = batch.mask.shape[:2]
    N, h, R = q_lat.shape
    P = q_pe.shape[-1]
    ql = q_lat.new_zeros(B * Tmax, h, R).index_copy_(0, batch.query_pad_index, q_lat).view(B, Tmax, h, R)
    qp = q_pe.new_zeros(B * Tmax, h, P).index_copy_(0, batch.query_pad_index, q_pe).view(B, Tmax, h, P)
    C = ckv.view(-1, R)[batch.context_slots].to(ql.dtype)                    # [B, L, R]
    K = kpe.view(-1, P)[batch.context_slots].to(qp.dtype)                    # [B, L, P]
    scores = (torch.einsum("bthr,blr->bhtl", ql, C) + torch.einsum("bthp,blp->bhtl", qp, K)).float()
    scores = scores * scale
    scores = scores.masked_fill(~batch.mask[:, None], float("-inf"))
    probs = scores.softmax(-1).to(C.dtype)
    out = torch.einsum("bhtl,blr->bthr", probs, C).reshape(B * Tmax, h, R)
    return out.index_select(0, batch.query_pad_index)
