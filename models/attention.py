"""Multi-head latent attention (MLA) over the paged latent cache, in the absorbed-weight form.

Per token the cache holds c_kv = kv_a_layernorm(W_DKV x) [R] and k_pe = rope(W_KR x) [P]; keys and
values are never expanded. With W_UK, W_UV the two halves of kv_b_proj (per head):
    score(q, j) = (q_nope W_UK) . c_kv[j] + q_pe . k_pe[j]
    out(q)      = (sum_j p_j c_kv[j]) W_UV^T

Backends (kernels.dispatch.paged_attention picks; TANDEM_ATTENTION, else TANDEM_KERNELS): kernels/mla.py
(PyTorch, the reference: CPU), kernels/triton_mla.py (CUDA), kernels/flashinfer_mla.py (CUDA, where
FlashInfer imports and R = 512, P = 64). Eager prefill steps (long prompts, chunks) take their own form
(kernels.dispatch.prefill_form, TANDEM_PREFILL): the flash-style absorbed kernel (kernels/triton_mla_prefill.py)
or the expanded one, K and V up-projected per head for the step (kernels/mla_expanded.py).

CUDA graphs: the Triton path reads no tensor value on the host, so a forward can be captured. Kept
static across replays (same storage, values rewritten in place before each replay): input ids and
AttentionBatch.positions, slot_mapping, token_request [N_pad]; context_lens [B_pad]; block_tables
[B_pad, max_blocks] (a fixed width, e.g. max_model_len / block_size); the cache tensors. Padding rows
point at a padding request with context_lens 0 (they output zeros) and at a scratch cache slot no
request owns (their K/V write lands there). Host fields (query_lens, request_ids, host_*) are not read
by the Triton path. The FlashInfer path plans per step on the host: inside a capture force Triton
(AttentionBatch.attention_backend = "triton"; models/cuda_graphs.py does).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import dispatch
from models.config import ModelConfig
from models.indexer import Indexer
from models.kv_cache import AttentionBatch, LayerKV
from models.layers import (ColumnParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding,
                           RowParallelLinear, fused, gemm_rows, linear)
from models.parallel import ParallelState, SINGLE


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ps: ParallelState = SINGLE):
        super().__init__()
        D, H, R, P = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.heads = ps.shard(H, "num_attention_heads")           # heads on this TP rank
        self.nope, self.rope_dim, self.v_dim, self.rank = cfg.qk_nope_head_dim, P, cfg.v_head_dim, R
        self.scale = cfg.softmax_scale
        self.rotary = rotary
        fp8 = cfg.quantization == "fp8"                 # the projections; kv_b is absorbed into the core
        if cfg.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(D, cfg.q_lora_rank, ps, fp8=fp8)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * cfg.qk_head_dim, ps, fp8=fp8)
        else:
            self.q_proj = ColumnParallelLinear(D, H * cfg.qk_head_dim, ps, fp8=fp8)
        self.kv_a_proj_with_mqa = ReplicatedLinear(D, R + P, ps, fp8=fp8)
        self.kv_a_layernorm = RMSNorm(R, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(R, H * (self.nope + self.v_dim), ps)
        self.o_proj = RowParallelLinear(H * self.v_dim, D, ps, fp8=fp8)
        self.indexer = Indexer(cfg, rotary, ps) if cfg.sparse_attention else None    # V3.2: DSA

    def forward(self, x: torch.Tensor, batch: AttentionBatch | None, kv: LayerKV | None = None):
        # x: [N, D]; kv: this layer's cache (ckv [blocks, block_size, R], kpe [blocks, block_size, P], ...)
        if batch is None:
            return self.forward_causal(x)
        N, h = x.shape[0], self.heads
        ckv, kpe = kv.ckv, kv.kpe
        q, q_latent, kv_a = self.project(x)
        q_nope, q_pe = q.view(N, h, -1).split([self.nope, self.rope_dim], -1)   # [N, h, nope], [N, h, P]
        rot, norm = self.rotary, self.kv_a_layernorm     # q_pe turned; c_kv normed and k_pe turned into the cache
        q_pe = dispatch.write_latent(q_pe, kv_a, norm.weight, norm.eps, batch.positions, rot.inv_freq,
                                     rot.attention_factor, rot.interleave, batch.slot_mapping, ckv, kpe)

        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]                          # [h, nope, R], [h, v, R]
        sparse = self.indexer is not None and self.indexer.enabled
        picks = self.indexer(x, q_latent, batch, kv) if sparse else None            # [N, topk] | None
        form = dispatch.prefill_form(q_pe, ckv, batch) if picks is None else None  # long prompts' own path
        if form == "expanded":                                                    # per-head K / V, then MHA
            out = dispatch.expanded_attention(q_nope, q_pe, batch, ckv, kpe, w, self.scale)   # [N, h, v]
            return self.o_proj(out.reshape(N, h * self.v_dim))
        q_lat = torch.einsum("nhd,hdr->nhr", dispatch.gemm_ready(q_nope), w_uk)[:N]   # [N, h, R]
        if form == "absorbed":
            out_lat = dispatch.prefill_attention(q_lat, q_pe, batch, ckv, kpe, self.scale)   # [N, h, R]
        elif picks is None:
            out_lat = dispatch.paged_attention(q_lat, q_pe, batch, ckv, kpe, self.scale, kv.arrivals)   # [N, h, R]
        else:                                                                     # only the selected keys
            out_lat = dispatch.sparse_mla(q_lat, q_pe, ckv, kpe, batch.block_tables, batch.token_request,
                                          picks, self.scale, batch.attention_backend)
        return self.o_proj(self.up_values(out_lat, w_uv))

    def up_values(self, out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        # out_lat [N, h, R] . w_uv [h, v, R] -> [N, h * v]; at inference written by the batched GEMM straight into
        # o_proj's input rows (the first rows of a gemm_rows buffer: no reshape copy, no copy into the buffer)
        N, h, _ = out_lat.shape
        if torch.is_grad_enabled():
            return torch.einsum("nhr,hvr->nhv", out_lat, w_uv).reshape(N, h * self.v_dim)
        out_lat = dispatch.gemm_ready(out_lat)                                    # CPU: 1-3 rows as 4
        M = out_lat.shape[0]
        out = out_lat.new_empty(max(M, gemm_rows(out_lat)), h * self.v_dim)[:M]
        torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.view(M, h, self.v_dim).transpose(0, 1))
        return out[:N]

    def project(self, x: torch.Tensor):
        # x: [N, D] -> (q [N, h * qk], q_latent [N, q_lora] | None, kv_a [N, R + P]); the two projections that read x
        # (q_a_proj or q_proj, and kv_a_proj_with_mqa) as one GEMM where they can (layers.fused)
        first = self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj
        both = fused(first, self.kv_a_proj_with_mqa)
        if both is None:
            a, kv_a = first(x), self.kv_a_proj_with_mqa(x)
        else:
            a, kv_a = linear(both, x).split([first.weight.shape[0], self.rank + self.rope_dim], -1)
        if not hasattr(self, "q_a_proj"):
            return a, None, kv_a
        q_latent = self.q_a_layernorm(a)                                         # [N, q_lora]
        return self.q_b_proj(q_latent), q_latent, kv_a

    def forward_causal(self, x: torch.Tensor) -> torch.Tensor:
        """Training / scoring path without a cache: x [B, T, D] -> [B, T, D], expanded K/V, causal."""
        B, T, _ = x.shape
        h, pos = self.heads, torch.arange(T, device=x.device)
        q_latent = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_a_proj") else None
        q = self.q_b_proj(q_latent) if q_latent is not None else self.q_proj(x)
        q_nope, q_pe = q.view(B, T, h, -1).split([self.nope, self.rope_dim], -1)
        q_pe = self.rotary(q_pe.reshape(B * T, h, -1), pos.repeat(B)).view(B, T, h, -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], -1)
        k_pe = self.rotary(k_pe.reshape(B * T, 1, -1), pos.repeat(B)).view(B, T, 1, -1).expand(B, T, h, -1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, h, -1).split([self.nope, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)                    # [B, h, T, qk]
        k = torch.cat([k_nope, k_pe], -1).transpose(1, 2)
        mask = self.indexer.causal_mask(x, q_latent) if self.indexer is not None else None   # [B, T, T] | None
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=mask is None, attn_mask=None if mask is None else mask[:, None],
            scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, h * self.v_dim))
