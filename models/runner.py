"""Plain functions over a model and its cache: prefill, decode, and a whole-sequence forward.

Used by tests, tools and the services; the services add batching and the wire around them.
"""
from __future__ import annotations

import torch

from models.kv_cache import PagedKVCache


def new_cache(model, num_blocks: int = 256, block_size: int = 16, index_scoring: str = "exact") -> PagedKVCache:
    """The paged cache a model needs, in its dtype and on its device (V3.2: with the indexer keys, scored
    `index_scoring`: exact | deployed)."""
    cfg, p = model.cfg, next(model.parameters())
    return PagedKVCache(model.num_cache_layers, num_blocks, block_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                        dtype=p.dtype, device=p.device, index_head_dim=cfg.index_head_dim or 0,
                        index_scoring=index_scoring)


@torch.inference_mode()
def forward_tokens(model, cache: PagedKVCache, seqs: dict[str, list[int]]) -> torch.Tensor:
    """Append each request's new tokens and run the target. -> final-norm hidden [N, D], request-major."""
    ids = list(seqs)
    new = [r for r in ids if r not in cache]
    for r in new:
        cache.allocate(r)
    try:
        batch = cache.prepare(ids, [len(seqs[r]) for r in ids], [t for r in ids for t in seqs[r]])
    except Exception:  # a step that does not fit (CacheFullError) leaves no request behind
        for r in new:
            cache.release(r)
        raise
    return model(batch.input_ids, batch, cache)


@torch.inference_mode()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, cache: PagedKVCache | None = None,
                    request_id: str = "r") -> list[int]:
    """Target-only greedy decoding (the reference every speculative path must equal)."""
    cache = cache or new_cache(model)
    hidden = forward_tokens(model, cache, {request_id: prompt})
    out = []
    for _ in range(max_new_tokens):
        tok = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        hidden = forward_tokens(model, cache, {request_id: [tok]})
    cache.release(request_id)
    return out
