"""The next Verify laid out while the draft proposes (issue 14, item 1: a step's host work off its critical path).

A Verify that names the next round's draft work (VerifyRequest.ahead: the speculating requests, k drafts each)
gives the target the next Verify's shape before the gateway sends it: those requests, k + 1 tokens each, from the
positions this Verify commits. Once it has answered, the target extends their caches by k + 1 positions and lays
the step out (PagedKVCache.prepare: block tables, positions, slots, uploaded into the CUDA graph's buffers); the
next Verify, if it is that step (the same requests in the same order, k drafts each, and no step laid out since),
adds only its tokens. Any other call first puts the extension back (a request ended or joined, fewer drafts, a
Prefill, Release or RecomputeRows between), and the step is laid out as before. Every rank runs the same calls
(RankGroup.call), so their caches stay alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.batch import AttentionBatch
from models.kv_cache import CacheFullError


@dataclass
class Laid:
    ids: list[str]
    ks: list[int]
    lengths: list[int]            # each request's cache length with the extension
    batch: AttentionBatch         # the step without its tokens
    layouts: int                  # the cache's layout count then: a later layout may have reused the graph's buffers


def lay_out(engine, ids: list[str], ks: list[int]) -> None:
    """The step of ids with ks drafts each, laid out now (engine.laid); nothing where it could not be the next
    Verify's (an unknown request, past max_model_len) or the cache has no room (the Verify will say so)."""
    drop(engine)
    reqs = [engine.requests.get(rid) for rid in ids]
    if not ids or None in reqs or len(set(ids)) != len(ids) or \
            any(k < 0 or r.num_tokens + k > engine.max_model_len for r, k in zip(reqs, ks)):
        return
    try:
        batch = engine.cache.prepare(ids, [k + 1 for k in ks])
    except CacheFullError:
        return
    engine.laid = Laid(list(ids), list(ks), [engine.cache.length(rid) for rid in ids], batch, engine.cache.layouts)


def take(engine, seqs: dict[str, list[int]]) -> AttentionBatch | None:
    """A Verify's tokens a request (the pending one, then its drafts) -> the step laid out ahead with them, if it is
    this one; else None, the extension put back."""
    laid, engine.laid = engine.laid, None
    if laid is None:
        return None
    if list(seqs) != laid.ids or [len(s) - 1 for s in seqs.values()] != laid.ks or engine.cache.layouts != \
            laid.layouts or [engine.cache.length(rid) for rid in laid.ids] != laid.lengths:
        _undo(engine, laid)
        return None
    engine.laid_ahead[0] += 1
    laid.batch.input_ids = torch.tensor([t for s in seqs.values() for t in s]).to(engine.cache.device,
                                                                                  non_blocking=True)
    return laid.batch


def drop(engine) -> None:
    """Before any other call that reads or changes the cache: the extension put back."""
    laid, engine.laid = engine.laid, None
    if laid is not None:
        _undo(engine, laid)


def _undo(engine, laid: Laid) -> None:
    engine.laid_ahead[1] += 1
    for rid, k, n in zip(laid.ids, laid.ks, laid.lengths):
        if rid in engine.cache and engine.cache.length(rid) == n:       # (released since: nothing left to undo)
            engine.cache.rollback(rid, k + 1)
