"""When the target's KV cache is full: preemption by recomputation, and admission held back.

Running requests grow a block every 16 tokens, so a full cache is load, not a fault: a Verify or Prefill that
finds no room fails on the target before it changes anything (RESOURCE_EXHAUSTED, details beginning with
infra.errors.KV_CACHE_FULL). Rather than ending the whole round with it:

* Verify: the newest running request gives its blocks back (released on both services) and waits again at
  the head of the queue; when admitted, its Prefill computes its prompt and the output so far
  (GenRequest.context_ids) and its stream goes on where it was (vLLM's recompute preemption). A seeded
  request moves its seed on (the target's draws restart with the new Prefill; its output is distributed as
  before, not bit-identical to a run without preemption). The others keep their tokens; this round's drafts
  are lost, so they are re-synced before they draft again (gateway/resync.py). The round runs again next step.
  Admission then waits until a request has ended (re-admitted at once, it would take the room back).
* Prefill: its new requests wait again at the head of the queue (chunks of prompts begun stay begun), and
  admission waits until a running request has ended, then admits half as many at a time until a Prefill
  fits. One request that does not fit when nothing else holds blocks fails (it never will).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from gateway.draft_state import DraftState
from infra.errors import KV_CACHE_FULL

if TYPE_CHECKING:
    from gateway.request import GenRequest
    from gateway.scheduler import Scheduler

log = logging.getLogger("tandem.gateway")
SEED_STEP = 0x9E3779B97F4A7C15                  # a preempted request's next seed: seed + SEED_STEP (mod 2**64)


def cache_full(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (e.details() or "").startswith(KV_CACHE_FULL)


def preempt(s: Scheduler, batch: list[GenRequest]) -> bool:
    """A Verify of `batch` found no room: the newest prompt still being prefilled, else the newest running
    request, gives its blocks back and waits again, recomputed later. False: `batch` is one request and
    nothing else of this gateway holds blocks (it fails)."""
    if s.prefilling:
        r = s.prefilling.pop()
        s.feed = [f for f in s.feed if f is not r]
    elif len(batch) > 1:
        r = batch[-1]
        s.running.remove(r)
    else:
        return False
    log.info("KV cache full: request %s (%d tokens) gives its blocks back and waits to be recomputed (%d "
             "running)", r.id, len(r.prompt_ids) + len(r.output_ids), len(s.running))
    _requeue(s, r)
    s.admit_after = s.freed                                    # back in when a request has ended
    for other in batch:                                        # this round's drafts are spent: re-synced later
        other.draft.lost()
    return True


def _requeue(s: Scheduler, r: GenRequest) -> None:
    if r.cancelled:                                            # its client is gone: it ends here
        s._finish(r, None)
        return
    s.release(r)
    r.id, r.preemptions = s.new_id(), r.preemptions + 1
    r.prefilled = r.cached_tokens = r.uncommitted = 0
    r.prompt_logprobs, r.draft = False, DraftState()           # the prompt was scored once already
    if r.sampling.HasField("seed"):
        r.sampling.seed = (r.sampling.seed + SEED_STEP) % (1 << 64)
    s.waiting.insert(0, r)
    s.preemptions += 1


def prefill_refused(s: Scheduler, reqs: list[GenRequest]) -> list[GenRequest]:
    """A Prefill of `reqs` found no room -> the requests that fail (none unless one alone cannot fit)."""
    if not s.running and len(s.prefilling) == 1:
        return reqs                                            # nothing else holds blocks: it never fits
    new = [r for r in reqs if r.prefilled == 0]
    for r in reversed(new):
        s.prefilling.remove(r)
        s.waiting.insert(0, r)
    if not s.running and not new:                              # begun prompts only: the newest starts over
        _requeue(s, s.prefilling.pop())
    s.admit_cap = max(1, len(new) // 2)
    s.admit_after = s.freed if s.running or s.prefilling else None
    log.info("KV cache full: %d new requests wait again (%d running, %d prefilling); admitting at most %d at a "
             "time", len(new), len(s.running), len(s.prefilling), s.admit_cap)
    return []


def admission(s: Scheduler, room: int) -> int:
    """How many waiting requests this step may admit, of `room`: none until a request has ended since a
    preemption or a refused Prefill, then at most the cap."""
    if s.admit_after is not None and s.freed <= s.admit_after:
        return 0
    return room if s.admit_cap is None else min(room, s.admit_cap)


def prefill_fitted(s: Scheduler) -> None:
    """A Prefill with new requests fitted: admission doubles its cap, unbounded again past the batch."""
    s.admit_after = None
    if s.admit_cap is not None:
        s.admit_cap = None if s.admit_cap * 2 >= s.max_batch else s.admit_cap * 2
