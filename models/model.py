"""DeepSeek-V3 target model and its MTP draft model. Both return hidden states; logits are a
separate call (`compute_logits`), the seam the MTP draft needs.

Checkpoint names: the target is `model.*` + `lm_head`; MTP layer i is `model.layers.{L + i}.*`
(enorm, hnorm, eh_proj, a full decoder layer, shared_head.norm, shared_head.head, embed_tokens).
"""
from __future__ import annotations

import os
import re

import torch
from torch import nn

from kernels import dispatch
from models.attention import MLAttention
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, LayerKV, PagedKVCache
from models.layers import (ParallelLMHead, ReplicatedLinear, RMSNorm, RotaryEmbedding,
                           VocabParallelEmbedding, cat_cols)
from models.moe import DenseMLP, MoE
from models.parallel import ParallelState, SINGLE, all_gather_rows, reduce_scatter_rows

# Test-only fault switch, read once at start: the MTP block skips its SP re-gather, so it returns
# this rank's ceil(T_pad / tp) rows instead of T. The row contract must catch it loudly.
FAULTS = set(filter(None, os.environ.get("TANDEM_FAULT", "").split(",")))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.self_attn = MLAttention(cfg, rotary, ps)
        self.mlp = (MoE(cfg, ps) if cfg.is_moe_layer(layer_idx) else
                    DenseMLP(cfg.hidden_size, cfg.intermediate_size, ps, cfg.quantization == "fp8"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # SP-MoE: the partial sums around the MoE are reduce-scattered instead of all-reduced
        self.sequence_parallel = ps.sequence_parallel and ps.tp_size > 1 and isinstance(self.mlp, MoE)
        if self.sequence_parallel:
            self.self_attn.o_proj.reduce = self.mlp.reduce = False

    def forward(self, x, batch: AttentionBatch | None, kv: LayerKV | None = None, gather: bool = True):
        # x: [N, D] -> [N, D] (with SP and gather=False: this rank's rows [ceil(N_pad / tp), D])
        if not self.sequence_parallel:
            x, y = self.step(x, None, batch, kv)
            return x + y
        g, tp = self.ps.tp_group, self.ps.tp_size
        n = x.shape[0]
        attn = self.self_attn(self.input_layernorm(x), batch, kv)                  # [N, D] partial sums
        h = dispatch.pad_shard_rows(x, tp, self.ps.tp_rank) + reduce_scatter_rows(dispatch.pad_rows(attn, tp), g, tp)
        # h: [S, D], S = ceil(N / tp): this rank's rows
        normed = all_gather_rows(self.post_attention_layernorm(h), g, tp)          # [N_pad, D]
        h = h + reduce_scatter_rows(self.mlp(normed), g, tp)                         # [S, D]
        return dispatch.trim_rows(all_gather_rows(h, g, tp), n) if gather else h

    def step(self, x, pending, batch: AttentionBatch | None, kv: LayerKV | None = None):
        # x: the residual stream [N, D]; pending: the layer before's output, not yet added (None: nothing)
        # -> (the stream with pending and attention added, this layer's MLP output: pending for the next layer).
        # Each residual add runs inside the norm after it (RMSNorm.add): one launch for both on CUDA.
        if self.sequence_parallel:
            return self(x if pending is None else x + pending, batch, kv), None
        x, h = self.input_layernorm.add(x, pending) if pending is not None else (x, self.input_layernorm(x))
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, batch, kv))
        return x, self.mlp(h)


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState = SINGLE):
        super().__init__()
        rotary = RotaryEmbedding(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, ps) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, batch: AttentionBatch | None, cache: PagedKVCache | None):
        # input_ids: [N] -> final-norm hidden [N, D]; without batch/cache: [B, T] -> [B, T, D], causal
        x, pending = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, pending = layer.step(x, pending, batch, cache.layer(i) if cache is not None else None)
        return self.norm(x) if pending is None else self.norm.add(x, pending)[1]


class TargetModel(nn.Module):
    """The full model (without MTP layers): hidden states, then logits on demand."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState = SINGLE):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.model = DeepseekV3Model(cfg, ps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ps)

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers

    def forward(self, input_ids, batch, cache):
        return self.model(input_ids, batch, cache)

    def compute_logits(self, hidden):
        # hidden: [M, D] -> fp32 logits [M, V]
        return self.lm_head(hidden)

    def checkpoint_names(self, name: str) -> list[str]:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ["lm_head.weight", "model.embed_tokens.weight"]
        return [name]

    def owns_checkpoint_name(self, name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return not (m and int(m.group(1)) >= self.cfg.num_hidden_layers)


class MTPLayer(DecoderLayer):
    """DeepSeek "nextn" block: h' = shared_head.norm(decoder(eh_proj([enorm(e); hnorm(h)])))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, ps: ParallelState):
        super().__init__(cfg, layer_idx, rotary, ps)
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * D, D, ps)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.skip_sp_gather = "skip_sp_gather" in FAULTS

    def forward(self, embeds, hidden, batch, kv: LayerKV | None):
        # embeds: [N, D] embedding of token i+1, hidden: [N, D] hidden of position i -> [N, D]
        x = self.eh_proj(cat_cols([self.enorm(embeds), self.hnorm(hidden)]))
        if self.sequence_parallel:
            return self.shared_head.norm(super().forward(x, batch, kv, gather=not self.skip_sp_gather))
        return self.shared_head.norm.add(*self.step(x, None, batch, kv))[1]


class DraftModel(nn.Module):
    """The MTP proposer: the checkpoint's nextn layer(s) with the (shared) embedding and LM head."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState = SINGLE):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("config.json: num_nextn_predict_layers is 0, the checkpoint has no MTP layer to draft with")
        self.cfg, self.ps = cfg, ps
        rotary = RotaryEmbedding(cfg)
        L = cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps)
        self.mtp = nn.ModuleList(MTPLayer(cfg, L + i, rotary, ps) for i in range(cfg.num_nextn_predict_layers))
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ps)

    @property
    def num_cache_layers(self) -> int:
        return len(self.mtp)

    def forward(self, input_ids, hidden, batch, cache, step: int = 0):
        # input_ids: [N] tokens i+1, hidden: [N, D] -> normed MTP hidden [N, D]; layer = step % layers
        # (without batch/cache: [B, T] and [B, T, D], causal, for training)
        i = step % len(self.mtp)
        return self.mtp[i](self.embed_tokens(input_ids), hidden, batch, cache.layer(i) if cache is not None else None)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def checkpoint_names(self, name: str) -> list[str]:
        L = self.cfg.num_hidden_layers
        if name == "embed_tokens.weight":
            return [f"model.layers.{L}.embed_tokens.weight", "model.embed_tokens.weight"]
        if name == "lm_head.weight":
            return [f"model.layers.{L}.shared_head.head.weight", "lm_head.weight", "model.embed_tokens.weight"]
        m = re.match(r"mtp\.(\d+)\.(.*)", name)
        return [f"model.layers.{L + int(m.group(1))}.{m.group(2)}"]

    def owns_checkpoint_name(self, name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return bool(m and int(m.group(1)) >= self.cfg.num_hidden_layers)
