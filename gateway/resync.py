"""Re-sync the draft's cache of running requests after it was lost (the draft restarted) or became
unknown (a Propose failed or timed out: it may or may not have run).

The draft's cache is derived state: it is rebuilt from each request's committed tokens and the
target's hidden rows for them. The gateway first drops whatever the draft still holds of the
requests (Release, awaited, so nothing of the old state can overtake what follows), then asks the
target to recompute the rows of every committed position but the last (RecomputeRows: scratch
cache entries, the request's own cache untouched), and the next Propose gives each request to the
draft as new: position 0, all committed tokens, one row per token but the last.

Invariant: a request proposes again only after all three steps; until then it decodes without
drafts (its tokens come from the target either way, so greedy output equals K = 0 throughout).

It reaches the services only through the scheduler's stubs (Release, RecomputeRows: gateway/stubs.py)
and reports through the scheduler's public fault methods (fail, draft_lost, target_lost).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from gateway.stubs import CONTRACT_CODES, client_status
from tandem.v1 import common_pb2, target_pb2

if TYPE_CHECKING:
    from gateway.request import GenRequest
    from gateway.scheduler import Scheduler

log = logging.getLogger("tandem.gateway")
RESYNC_TOKENS = 8192          # committed tokens per RecomputeRows call (bounds its scratch cache and message)


def chunks(reqs: list[GenRequest], limit: int = RESYNC_TOKENS) -> list[list[GenRequest]]:
    """Consecutive groups of `reqs` of at most `limit` committed tokens each (one request may exceed it)."""
    out, cur, n = [], [], 0
    for r in reqs:
        size = len(r.prompt_ids) + len(r.output_ids)
        if cur and n + size > limit:
            out.append(cur)
            cur, n = [], 0
        cur.append(r)
        n += size
    return out + ([cur] if cur else [])


async def resync(s: Scheduler, reqs: list[GenRequest]) -> None:
    """Scheduler `s`: make the stale requests `reqs` ready to propose as new requests (its wall: the
    resync phase of tandem:round_phase_seconds)."""
    t_start = time.perf_counter()
    try:
        await s.draft.Release(common_pb2.ReleaseRequest(request_ids=[r.id for r in reqs]), timeout=s.draft_timeout)
    except grpc.aio.AioRpcError as e:
        s.draft_lost(f"draft Release before a re-sync failed ({e.code().name}: {e.details()})")
        return
    done = 0
    for chunk in chunks(reqs):
        req = target_pb2.RecomputeRowsRequest(transport=s.transport, items=[target_pb2.RecomputeItem(
            request_id=r.id, token_ids=list(r.prompt_ids) + list(r.output_ids)) for r in chunk])
        t0 = time.perf_counter()
        try:
            resp = await s.target.RecomputeRows(req, timeout=s.timeout)
        except grpc.aio.AioRpcError as e:
            give_up(s, chunk, e)
            continue
        s.policy.resynced(sum(len(it.token_ids) for it in req.items), time.perf_counter() - t0)
        done += sum(not r.draft.probe for r in chunk)          # a probe the policy asked for is no fault
        for r in chunk:
            r.draft.resynced(list(r.prompt_ids) + list(r.output_ids), resp.hidden_rows)
    s.avail.resynced += done
    s.obs.phase("resync", time.perf_counter() - t_start)
    if done:
        log.info("re-synced the draft's cache of %d running requests", done)


def give_up(s: Scheduler, chunk: list[GenRequest], e: grpc.aio.AioRpcError) -> None:
    """RecomputeRows failed. A contract error (the gateway's committed tokens disagree with the
    target's) fails the requests; UNAVAILABLE leaves them stale (the round fails them anyway if the
    target is gone); anything else (RESOURCE_EXHAUSTED: no room for the scratch cache) lets them
    finish without drafts."""
    if e.code() in CONTRACT_CODES:
        for r in chunk:
            s.fail(r, client_status(e), f"target RecomputeRows: {e.details()}")
    elif client_status(e) == grpc.StatusCode.UNAVAILABLE:
        s.target_lost(f"RecomputeRows failed: {e.details()}")
    else:
        log.warning("re-sync of %d requests failed (%s: %s); they finish without drafts",
                    len(chunk), e.code().name, e.details())
        for r in chunk:
            r.draft.dropped()
