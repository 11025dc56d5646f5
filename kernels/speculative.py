"""Acceptance and sampling math of speculative decoding, as small pure functions (PyTorch reference).

Shapes: B requests, K draft slots (requests with fewer drafts are masked by `num_drafts`), V vocab.
Emitted tokens are padded with -1 after the a + 1 valid ones.
"""
from __future__ import annotations

import torch

# Temperatures below this sample like greedy: logits / 1e-45 overflow to inf and softmax turns them into
# NaN, whose argmax is token 0 (found by fuzzing); vLLM uses the same threshold.
SAMPLING_EPS = 1e-5


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """logits [M, V] -> probs [M, V] after temperature, top-k (0 = off), top-p (0 or 1 = off).

    Rows with temperature < SAMPLING_EPS become one-hot at the argmax (greedy as a distribution).
    truncate=False: the caller knows no row asks top-k or top-p, so no row is sorted (a sort of every row
    costs more than the rest together at a large vocabulary).
    """
    logits = logits.float()
    greedy = temperature < SAMPLING_EPS
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    onehot = torch.zeros_like(x).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if not truncate:
        return torch.where(greedy[:, None], onehot, x.softmax(-1))
    V = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).long()
    sorted_x, order = x.sort(-1, descending=True)
    keep = torch.arange(V, device=x.device)[None, :] < k[:, None]                 # top-k
    p_sorted = sorted_x.masked_fill(~keep, float("-inf")).softmax(-1)
    use_p = (top_p > 0) & (top_p < 1)
    before = p_sorted.cumsum(-1) - p_sorted                                        # mass ranked above
    keep &= ~(use_p[:, None] & (before >= top_p[:, None]))                         # top-p (keeps >= 1)
    sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    probs = torch.empty_like(x).scatter_(-1, order, sorted_x.softmax(-1))
    return torch.where(greedy[:, None], onehot, probs)


def greedy_verify(target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor):
    """target_ids [B, K+1] (target argmax at each verified position), draft_ids [B, K], num_drafts [B]
    -> accepted [B], emitted [B, K+1]: the longest prefix where draft == target, then the target's token."""
    B, K = draft_ids.shape
    pos = torch.arange(K + 1, device=target_ids.device)
    match = (draft_ids == target_ids[:, :K]) & (pos[None, :K] < num_drafts[:, None])
    accepted = match.long().cumprod(1).sum(1)
    emitted = target_ids.masked_fill(pos[None, :] > accepted[:, None], -1)  # drafts equal targets up to a
    return accepted, emitted


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     uniform: torch.Tensor, exp_noise: torch.Tensor):
    """Lossless speculative sampling.

    p [B, K+1, V] target probs, q [B, K, V] draft probs, draft_ids [B, K], num_drafts [B],
    uniform [B, K] ~ U(0, 1), exp_noise [B, V] ~ Exp(1) -> accepted [B], emitted [B, K+1].
      accept d_i while u_i * q(d_i) <= p(d_i)              (probability min(1, p/q))
      at the first rejection a: sample norm(max(0, p_a - q_a))
      if all k accepted: sample the bonus token from p_k
    Sampling w: argmax(w / E) with E ~ Exp(1) picks i with probability w_i / sum(w).
    """
    B, K = draft_ids.shape
    pos = torch.arange(K + 1, device=p.device)
    if K:
        p_d = p[:, :K].gather(-1, draft_ids[..., None]).squeeze(-1)
        q_d = q.gather(-1, draft_ids[..., None]).squeeze(-1)
        accept = (uniform * q_d <= p_d) & (pos[None, :K] < num_drafts[:, None])
        accepted = accept.long().cumprod(1).sum(1)
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=p.device)
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, accepted]                                                      # [B, V]
    rejected = accepted < num_drafts
    q_a = q[rows, accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_a)
    residual = torch.where(rejected[:, None], (p_a - q_a).clamp(min=0), p_a)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)    # p == q: fall back to p
    last = (residual / exp_noise).argmax(-1)
    drafts = torch.cat([draft_ids, draft_ids.new_zeros(B, 1)], 1)                 # [B, K+1] (K = 0 too)
    emitted = torch.where(pos[None, :] < accepted[:, None], drafts, last[:, None])
    return accepted, emitted.masked_fill(pos[None, :] > accepted[:, None], -1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> [M] int64, each row's first maximal index (as torch.argmax), in two stages so that a few long
    rows (a decode step's logits) spread over the GPU: the max of each of C chunks, then across the chunks.
    (torch.argmax reduces a row in one thread block: 22 us for one 102400-wide row on an H200.)"""
    M, V = x.shape
    C = next((c for c in (128, 100, 64, 50, 32, 25, 16, 10, 8) if V % c == 0 and V // c >= 256), 0)
    if not C:
        return x.argmax(-1)
    vals, idx = x.reshape(M, C, V // C).max(-1)                                  # [M, C]
    c = vals.argmax(-1)                                                          # [M] first chunk with the max
    return c * (V // C) + idx.gather(1, c[:, None]).squeeze(1)


def greedy_accept(logits: torch.Tensor, rows: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor):
    """logits [N, V], rows [B, K+1] (each verified position's logit row), draft_ids [B, K], num_drafts [B] ->
    (accepted | emitted [B, K+2] int64: greedy_verify's two outputs side by side, target [B, K+1]: the argmax)."""
    target = argmax_rows(logits)[rows]
    accepted, emitted = greedy_verify(target, draft_ids, num_drafts)
    return torch.cat([accepted[:, None], emitted.long()], 1), target
