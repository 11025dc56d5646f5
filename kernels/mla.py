"""Paged MLA attention in the absorbed form, the PyTorch reference (kernels/triton_mla.py and the FlashInfer
adapter compute the same on CUDA). `batch` is a models.batch.AttentionBatch: its reference layout
(reference_groups: context_slots [B, Lmax], query_pad_index [N], mask [B, Tmax, Lmax] by groups) is built from the
host copy on first use."""
from __future__ import annotations

import torch

from kernels import norm


def write_latent(q_pe, kv_a, weight, eps: float, positions, inv_freq, factor: float, interleave: bool, slot_mapping,
                 ckv, kpe) -> torch.Tensor:
    """A step's MLA inputs (kernels/triton_mla_write.py does it in one launch): q_pe [N, h, P] -> q_pe turned by
    its positions; c_kv, k_pe = kv_a [N, R + P] split -> RMSNorm(c_kv) into ckv and k_pe turned into kpe, at
    slot_mapping [N] (flat slots of the paged cache)."""
    R, P = ckv.shape[-1], kpe.shape[-1]
    c_kv, k_pe = kv_a.split([R, P], -1)
    ckv.view(-1, R)[slot_mapping] = norm.rms_norm(c_kv, weight, eps).to(ckv.dtype)
    k_pe = norm.rotary(k_pe[:, None], positions, inv_freq, factor, interleave)[:, 0]
    kpe.view(-1, P)[slot_mapping] = k_pe.to(kpe.dtype)
    return norm.rotary(q_pe, positions, inv_freq, factor, interleave)


def latent_attention(q_lat, q_pe, batch, ckv, kpe, scale: float) -> torch.Tensor:
    """Reference attention over the latent cache. q_lat: [N, h, R], q_pe: [N, h, P] -> [N, h, R]. Requests are
    padded to a common query length by groups (AttentionBatch.reference_groups: decode and verify rows apart from
    prompt chunks)."""
    groups = batch.reference_groups()
    if len(groups) == 1:
        return _padded_attention(q_lat, q_pe, *groups[0][1:], ckv, kpe, scale)
    out = q_lat.new_empty(q_lat.shape)
    for rows, slots, pad, mask in groups:
        out[rows] = _padded_attention(q_lat[rows], q_pe[rows], slots, pad, mask, ckv, kpe, scale)
    return out


def _padded_attention(q_lat, q_pe, context_slots, query_pad_index, mask, ckv, kpe, scale: float) -> torch.Tensor:
    """q_lat: [n, h, R], q_pe: [n, h, P] of b requests padded to [b, Tmax] (query_pad_index [n]); their context at
    context_slots [b, Lmax]; mask [b, Tmax, Lmax] -> [n, h, R]."""
    B, Tmax = mask.shape[:2]
    N, h, R = q_lat.shape
    P = q_pe.shape[-1]
    ql = q_lat.new_zeros(B * Tmax, h, R).index_copy_(0, query_pad_index, q_lat).view(B, Tmax, h, R)
    qp = q_pe.new_zeros(B * Tmax, h, P).index_copy_(0, query_pad_index, q_pe).view(B, Tmax, h, P)
    C = ckv.view(-1, R)[context_slots].to(ql.dtype)                          # [B, L, R]
    K = kpe.view(-1, P)[context_slots].to(qp.dtype)                          # [B, L, P]
    scores = (torch.einsum("bthr,blr->bhtl", ql, C) + torch.einsum("bthp,blp->bhtl", qp, K)).float()
    scores = scores * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = scores.softmax(-1).to(C.dtype)
    out = torch.einsum("bhtl,blr->bthr", probs, C).reshape(B * Tmax, h, R)
    return out.index_select(0, query_pad_index)
