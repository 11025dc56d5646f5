"""The roofline of a speculative round (docs/DESIGN.md, "Floors and the roofline"): byte floors from the
model's shapes, for `tandem bench speed`.

A decode step at small batch is bound by the bytes it reads: every dense weight, the routed experts its
tokens pick, the embedding rows and LM head, and each request's cached keys. Parameters are counted on the
meta device (no memory), in the serving dtype. Routed experts touched per MoE layer by N tokens with top-k of
E are taken at their expectation under uniform routing, E (1 - (1 - k/E)^N) (random weights route about
uniformly; a trained router that sends related tokens to the same experts reads fewer).

    ideal round  = floor(verify of K + 1 tokens per request) + K x floor(one MTP step)
    ideal tok/s  = batch x mean acceptance length / ideal round
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shapes:
    dense: int            # bytes: weights every token reads (attention, norms, dense MLPs, shared experts, routers)
    expert: int           # bytes of one routed expert
    moe_layers: int
    emb_row: int
    head: int
    kv_per_token: int     # bytes of cached keys one position costs, per layer (dense attention)
    layers: int


def shapes(cls, cfg, dtype: torch.dtype) -> Shapes:
    """Byte counts of a TargetModel or DraftModel of `cfg` in `dtype` (fp8 weights and their scales as held)."""
    from models.loader import build
    m = build(cls, cfg, dtype=dtype, device="meta")
    size = torch.empty((), dtype=dtype).element_size()
    dense = expert = 0
    for name, p in m.named_parameters():
        if ".experts." in name:
            expert += p.numel() * p.element_size()
        elif not (name.endswith("embed_tokens.weight") or name.startswith("lm_head")):
            dense += p.numel() * p.element_size()
    moe_layers = sum(1 for mod in m.modules() if type(mod).__name__ == "MoE")
    per_expert = expert // max(moe_layers * cfg.n_routed_experts, 1)
    kv = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
    return Shapes(dense, per_expert, moe_layers, cfg.hidden_size * size, cfg.vocab_size * cfg.hidden_size * size,
                  kv, m.num_cache_layers)


def experts_touched(cfg, tokens: int) -> float:
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens) if E else 0.0


def step_bytes(s: Shapes, cfg, batch: int, tokens_per_request: int, context: int) -> float:
    """Bytes one forward + LM head of `batch` requests x `tokens_per_request` reads at `context` cached positions."""
    n = batch * tokens_per_request
    keys = context * s.kv_per_token
    if getattr(cfg, "sparse_attention", False):              # V3.2: every index key, the picked latent keys
        keys = context * (cfg.index_head_dim + 4) + min(context, cfg.index_topk) * tokens_per_request * s.kv_per_token
    return (s.dense + s.moe_layers * experts_touched(cfg, n) * s.expert + min(n, cfg.vocab_size) * s.emb_row
            + s.head + s.layers * batch * keys)


@functools.lru_cache(maxsize=8)
def model_shapes(model: str, dtype: torch.dtype, quantization: str = "auto", draft_quantization: str = "",
                 device: str = ""):
    """(config, target Shapes, draft Shapes) of a model id as `device` holds it (ModelConfig.quantized), once."""
    from models.model import DraftModel, TargetModel
    from models.presets import model_config
    cfg = model_config(model)
    return (cfg, shapes(TargetModel, cfg.quantized(quantization, device), dtype),
            shapes(DraftModel, cfg.quantized(draft_quantization or quantization, device), dtype))


def round_floor_ms(model: str, dtype: torch.dtype, batch: int, k: int, context: int, bandwidth: float,
                   quantization: str = "auto", draft_quantization: str = "", device: str = "") -> dict:
    """Floors in ms of the verify step (K + 1 tokens per request) and of K draft steps, and their sum."""
    cfg, target, draft_shapes = model_shapes(model, dtype, quantization, draft_quantization, device)
    verify = step_bytes(target, cfg, batch, k + 1, context) / bandwidth
    draft = k * step_bytes(draft_shapes, cfg, batch, 1, context) / bandwidth if k else 0.0
    return {"verify_floor_ms": 1000 * verify, "draft_floor_ms": 1000 * draft, "ideal_round_ms": 1000 * (verify + draft)}
