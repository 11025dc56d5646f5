"""A new request the draft did not take (ProposeResult.not_held), recovered within the same round.

The target found part of the prompt in its prefix cache and sent rows only for the rest; the draft's own
prefix cache had lost those first positions (its pool evicted them, or another draft built the target's
blocks: several gateways may pair one target with different drafts). The gateway asks the target for the
rows of every position (RecomputeRows: scratch cache, the request's own untouched) and proposes again for
these requests alone, as new requests with no cached positions, so their first round still has drafts: the
tokens (seeded sampling included) and the acceptance are those of a run without prefix caching.

Any failure leaves them to the ordinary path: no drafts this round, re-synced later (gateway/resync.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from gateway.stubs import CONTRACT_CODES, client_status
from tandem.v1 import draft_pb2, target_pb2

if TYPE_CHECKING:
    from gateway.request import GenRequest
    from gateway.scheduler import Scheduler

log = logging.getLogger("tandem.gateway")


async def recover(s: Scheduler, reqs: list[GenRequest], drafts: dict) -> None:
    """Scheduler `s`: re-propose `reqs` (not_held) with every row; their results go into `drafts`."""
    tokens = {r.id: list(r.prompt_ids) + list(r.output_ids) for r in reqs}
    call, t0 = "target RecomputeRows", time.perf_counter()
    try:
        rows = (await s.target.RecomputeRows(target_pb2.RecomputeRowsRequest(transport=s.transport, items=[
            target_pb2.RecomputeItem(request_id=r.id, token_ids=tokens[r.id]) for r in reqs]),
            timeout=s.timeout)).hidden_rows
        call = "draft Propose"
        resp = await s.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
            request_id=r.id, new_token_ids=tokens[r.id], num_draft_tokens=r.round_k(), sampling=r.sampling,
            position=0) for r in reqs], hidden_rows=[rows], gateway_session=s.session), timeout=s.draft_timeout)
    except grpc.aio.AioRpcError as e:
        for r in reqs:
            drafts.pop(r.id, None)
            if e.code() in CONTRACT_CODES:        # as in a round: the requests fail with it
                s.fail(r, client_status(e), f"{call}: {e.details()}")
            else:
                r.draft.lost()
        if e.code() not in CONTRACT_CODES:
            log.warning("re-proposing %d requests the draft's prefix cache lacked failed (%s %s: %s); they "
                        "are re-synced later", len(reqs), call, e.code().name, e.details())
        return
    log.debug("re-proposed %d requests the draft's prefix cache lacked (%d tokens) in %.1f ms", len(reqs),
              sum(map(len, tokens.values())), 1e3 * (time.perf_counter() - t0))
    for r, res in zip(reqs, resp.results):
        drafts[r.id] = res
        r.draft.position, r.draft.pending = 0, tokens[r.id]
        if res.not_held:
            r.draft.lost()
        else:
            r.draft.proposed()
