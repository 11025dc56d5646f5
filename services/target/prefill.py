"""The target's Prefill, whole or in chunks (issue 17): which prompt positions a call computes.

A call computes, per item, positions [start, end) of its prompt. start: for a new request the positions
found in the prefix cache (models/prefix_cache.py; never the last one, whose row starts the draft, and
none when the prompt is scored, which needs every row), for a request prefilled in chunks the positions
earlier calls computed. end: the prompt's length, or start + the item's chunk budget when that is less;
then the request stays prefilling (no first token) until a call reaches the end. Chunks compute the same
positions with the same cache as a whole prefill, so the tokens are the same either way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infra.errors import ServiceError

if TYPE_CHECKING:
    from services.target.engine import TargetEngine

LOGPROB_CHUNK = 256          # prompt positions scored per LM-head call (bounds the [rows, V] buffer)


def check_items(engine: TargetEngine, items: list, scored: list[bool]) -> None:
    """Refuse a Prefill before any work: ids repeated or running, empty or too long prompts, bad ids,
    a scored prompt in chunks, a chunk whose prompt is not the one its request started with."""
    ids = [rid for rid, _, _ in items]
    if len(set(ids)) != len(ids):
        raise ServiceError("INVALID_ARGUMENT", "request ids in one Prefill must be unique")
    for (rid, prompt, _), score in zip(items, scored):
        if rid in engine.requests:
            raise ServiceError("ALREADY_EXISTS", f"request {rid!r} is already running")
        if rid in engine.partial:
            if len(prompt) != engine.partial[rid][1] or score:
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: a later chunk of a prompt of "
                                   f"{engine.partial[rid][1]} tokens has {len(prompt)} (and may not be scored)")
            continue
        if not prompt:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: prompt_token_ids is empty")
        if len(prompt) >= engine.max_model_len:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: prompt has {len(prompt)} tokens, "
                                                   f"max_model_len is {engine.max_model_len}")
        engine._check_tokens(rid, "prompt_token_ids", prompt)


def spans(engine: TargetEngine, items: list, scored: list[bool], budgets: list[int]) -> list[tuple[int, int]]:
    """Start new requests' caches (on cached prefix blocks where found) -> (start, end) per item."""
    out = []
    for (rid, prompt, _), score, budget in zip(items, scored, budgets):
        if rid in engine.partial:
            start = engine.partial[rid][0]
        else:
            use = engine.cache.pool.enabled and not score
            hit = engine.cache.lookup(prompt, len(prompt) - 1) if use else None
            engine.cache.allocate(rid, hit)
            start = hit.positions if hit else 0
        end = len(prompt) if score or budget <= 0 else min(len(prompt), start + budget)
        out.append((start, end))
    return out


def score(engine: TargetEngine, items: list, logprobs: list, hidden: torch.Tensor, spans_: list,
          last_logits: torch.Tensor, first: list[int]) -> list[dict]:
    """Per item {"prompt": [T - 1 entries] if scored, "first": the first token's entry or None}."""
    from services.target.verify_io import token_logprobs
    out, row, b_done = [], 0, 0
    for (_, prompt, _), (n, scored), (s, e) in zip(items, logprobs, spans_):
        entry = {"prompt": [], "first": None}
        if scored:                            # row j's logits score prompt token j + 1 (s == 0, e == T)
            for i in range(0, len(prompt) - 1, LOGPROB_CHUNK):
                j = min(i + LOGPROB_CHUNK, len(prompt) - 1)
                entry["prompt"] += token_logprobs(engine.model.compute_logits(hidden[row + i: row + j]),
                                                  prompt[i + 1: j + 1], n or 0)
        if e == len(prompt):
            if n is not None:
                entry["first"] = token_logprobs(last_logits[b_done: b_done + 1], [first[b_done]], n)[0]
            b_done += 1
        out.append(entry)
        row += e - s
    return out
