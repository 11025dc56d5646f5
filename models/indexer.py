"""The DeepSeek-V3.2 lightning indexer: which index_topk cached keys each query's MLA attention reads.

Per layer, replicated on every TP rank (it is small, and every rank must pick the same keys):
    q = wq_b(q_latent) [H, D]     (q_latent = the attention's q_a_layernorm(q_a_proj(x)))
    k = k_norm(wk(x))  [D]        (LayerNorm with bias; one key per token, cached with the MLA latent)
    RoPE on the first qk_rope_head_dim dims, half-split layout, rope part first (unlike the MLA's own)
    w = weights_proj(x) * H^-1/2 * D^-1/2   (fp32; weights_proj is kept in fp32)
    score[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]), causal; keep the top min(index_topk, t + 1)
Scoring follows the cache's key dtype (kernels/dsa.py): exact (model dtype keys, fp32 scores) or deployed
(Hadamard-rotated q and k in fp8 e4m3 with power-of-two scales, as DeepSeek's kernels).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import dispatch
from kernels.dsa import quantize_pow2, rotate, topk_indices
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, LayerKV
from models.layers import LayerNorm, ReplicatedLinear, RotaryEmbedding
from models.parallel import ParallelState, SINGLE

SCORE_BUDGET = 1 << 26          # eager steps score at most this many (row, key) pairs at once (256 MB fp32)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ps: ParallelState = SINGLE):
        super().__init__()
        D, H, Dk = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        self.heads, self.dim, self.topk, self.rope_dim = H, Dk, cfg.index_topk, cfg.qk_rope_head_dim
        self.rotary = rotary
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, H * Dk, ps)
        self.wk = ReplicatedLinear(D, Dk, ps)
        self.k_norm = LayerNorm(Dk)
        self.weights_proj = ReplicatedLinear(D, H, ps, dtype=torch.float32)
        self.enabled = True       # False: the attention skips the indexer and reads every key (dense: the
                                  # benchmarks' baseline; the tests showing that DSA matters)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor):
        # x: [N, D], q_latent: [N, q_lora], positions: [N] -> q [N, H, Dk], k [N, Dk], w [N, H] fp32
        N, P = x.shape[0], self.rope_dim
        q = self.wq_b(q_latent).view(N, self.heads, self.dim)
        k = self.k_norm(self.wk(x))
        q = torch.cat([self.rotary(q[..., :P], positions, interleave=False), q[..., P:]], -1)
        k = torch.cat([self.rotary(k[:, None, :P], positions, interleave=False)[:, 0], k[:, P:]], -1)
        w = self.weights_proj(x.float()) * (self.heads ** -0.5 * self.dim ** -0.5)
        return q, k, w

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, batch: AttentionBatch, kv: LayerKV):
        """Write this step's keys to the cache; -> [N, k] int32 positions each row attends (-1: none), or
        None when every row may attend all its keys (dense attention is then the same)."""
        q, k, w = self.project(x, q_latent, batch.positions)
        if kv.index_scale is not None:                                  # deployed scoring
            (q, q_scale), (k, k_scale) = quantize_pow2(rotate(q)), quantize_pow2(rotate(k))
            w = w * q_scale
            kv.index_scale.view(-1)[batch.slot_mapping] = k_scale
        kv.index_k.view(-1, self.dim)[batch.slot_mapping] = k.to(kv.index_k.dtype)
        if batch.host_starts is not None:                               # host layout known (not a graph)
            if max((s + n for s, n in zip(batch.host_starts, batch.query_lens)), default=0) <= self.topk:
                return None
        width = batch.block_tables.shape[1] * batch.block_size
        N = q.shape[0]
        rows = N if batch.host_starts is None else max(1, min(N, SCORE_BUDGET // width))
        picks = []
        for s in range(0, N, rows):                                     # long prefills: in row chunks
            e = min(N, s + rows)
            scores = dispatch.index_scores(q[s:e], w[s:e], kv.index_k, kv.index_scale, batch.block_tables,
                                           batch.token_request[s:e], batch.positions[s:e], batch.context_lens, width)
            picks.append(topk_indices(scores, self.topk))
        return picks[0] if len(picks) == 1 else torch.cat(picks)

    def causal_mask(self, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor | None:
        """Training / scoring path without a cache (exact scoring): x [B, T, D] -> [B, T, T] bool, True
        where query t may attend key s (causal and selected), or None when dense."""
        B, T, _ = x.shape
        if not self.enabled or T <= self.topk:
            return None
        pos = torch.arange(T, device=x.device).repeat(B)
        q, k, w = self.project(x.reshape(B * T, -1), q_latent.reshape(B * T, -1), pos)
        q, k, w = q.view(B, T, self.heads, self.dim), k.view(B, T, self.dim), w.view(B, T, self.heads)
        scores = torch.einsum("bth,bths->bts", w, torch.einsum("bthd,bsd->bths", q.float(), k.float()).relu())
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        idx = scores.topk(self.topk, dim=-1).indices                               # [B, T, topk]
        return torch.zeros(B, T, T, dtype=torch.bool, device=x.device).scatter_(-1, idx, True) & causal


def set_sparse(model, on: bool) -> None:
    """Every indexer of `model` on (DSA) or off (dense attention: the benchmarks' baseline)."""
    for m in model.modules():
        if isinstance(m, Indexer):
            m.enabled = on
