"""MLA prefill in the expanded form (issue 17): per request, the context's latent c_kv [L, R] is up-projected by
kv_b_proj into per-head keys [nope | rope] and values [v], and causal attention runs on them as ordinary
multi-head attention (torch SDPA: FlashAttention or the memory-efficient kernel on CUDA, the math path on CPU).

Per (query, key, head) pair this costs qk + v multiply-adds (192 + 128 at DeepSeek's shapes) against 2R + P
(1088) in the absorbed form (kernels/triton_mla_prefill.py), plus the up-projection of each context key once
per step (L x h x (nope + v) x R): less work once a request brings more than a few hundred query rows.
kernels/dispatch.prefill_form picks the form for eager prefill steps.

Request b's query rows are the last n of its L = start + n context positions, so the causal mask is aligned
bottom-right (row i sees keys <= start + i). On CUDA in half precision the values are zero-padded to the key
width, which FlashAttention needs (equal head dims); elsewhere they keep theirs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def _requests(batch) -> list[tuple[int, int, int, torch.Tensor]]:
    """Per request (first row, end row, context length L, flat cache slots of its L keys [L] on the device),
    built once per step (every layer reuses it)."""
    if "expanded" not in batch.plans:
        bs, dev, out, row = batch.block_size, batch.block_tables.device, [], 0
        for b, (s, n) in enumerate(zip(batch.host_starts, batch.query_lens)):
            j = torch.arange(s + n, device=dev)
            slots = batch.block_tables[b, j // bs].long() * bs + j % bs
            out.append((row, row + n, s + n, slots))
            row += n
        batch.plans["expanded"] = out
    return batch.plans["expanded"]


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, batch, ckv: torch.Tensor, kpe: torch.Tensor,
                       w_kv: torch.Tensor, scale: float) -> torch.Tensor:
    """q_nope [N, h, nope], q_pe [N, h, P] (roped) over one layer's paged cache (ckv [blocks, bs, R], kpe
    [blocks, bs, P]; batch: a models.kv_cache.AttentionBatch with its host layout), w_kv: kv_b_proj's weight
    as [h, nope + v, R] -> [N, h, v], the attention output before o_proj."""
    N, h, nope = q_nope.shape
    R, P, v_dim = ckv.shape[-1], q_pe.shape[-1], w_kv.shape[1] - nope
    out = q_nope.new_empty(N, h, v_dim)
    pad = nope + P - v_dim if q_nope.is_cuda and q_nope.dtype in (torch.float16, torch.bfloat16) else 0
    w = w_kv.reshape(h * (nope + v_dim), R)
    for r0, r1, L, slots in _requests(batch):
        n = r1 - r0
        if n == 0:
            continue
        c = ckv.view(-1, R)[slots].to(q_nope.dtype)                                # [L, R]
        kv = (c @ w.t()).view(L, h, nope + v_dim)                                  # [L, h, nope + v]
        k = torch.cat([kv[..., :nope], kpe.view(-1, P)[slots].to(q_nope.dtype)[:, None].expand(L, h, P)], -1)
        v = F.pad(kv[..., nope:], (0, pad)) if pad else kv[..., nope:]           # [L, h, v (+ pad)]
        q = torch.cat([q_nope[r0:r1], q_pe[r0:r1]], -1)                             # [n, h, nope + P]
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))                  # [1, h, len, dim]
        if n == L:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(n, L), scale=scale)
        out[r0:r1] = o[0, :, :, :v_dim].transpose(0, 1)                            # [n, h, v]
    return out
