"""Prefill mixed into rounds (issue 17, item 2): each scheduler step sends at most one Prefill, then the round.

`--max-num-batched-tokens` (vLLM's flag) is the prompt positions one step may prefill. With a budget, a
step's Prefill takes chunks of the prompts already partly prefilled (oldest first), then admits waiting
requests while budget and batch room are left, each item with `max_chunk_tokens` (services/target/prefill.py);
the round of the running requests follows. A long prompt thus delays the running streams by one chunk per
round, not by its whole prefill. A prompt whose last chunk completes gets its first token and joins the
running batch. Budget 0: every admitted prompt whole, as before chunking. A prompt scored for
prompt_logprobs is always sent whole (the target scores only whole prompts): alone in its step when it is
larger than the budget left.

The draft is filled chunk by chunk with the alignment of a round (MTP position i pairs token i + 1 with the
target's row i): a chunk computing prompt positions [s, e) sends the draft the tokens up to e (inclusive) with
the rows of [s, e), as items asking no drafts (`Scheduler.feed`) in the same step's round Propose, or in a
Propose of their own when the round makes none. One Propose: the step's row set is taken once on the bridge,
and the prompts the same Prefill completed start their first round on it. The first chunk is a new request
(`DraftState.prefilled`, from position 0, its prefix hit as cached_tokens), later ones continue it
(`DraftState.verified`); the last chunk's tokens and first token go with the request's first round, as after
a whole prefill. A request that wants no drafts (k = 0) while the draft speculates for others is fed its prompt
the same way, its last chunk and first token too, and no more (`DraftState.prompt_only`): the draft's prefix
cache then holds every prompt the target's does. Faults follow the rounds' rules (gateway/scheduler.py): a
failed chunk Prefill ends its requests with the target's status; a failed chunk Propose costs drafts, not
tokens (the requests are re-synced once running), and a contract error ends the chunk's requests (a prompt-only
one's feed just stops). Partial prompts live in `Scheduler.prefilling`, where cancel(), deadlines and service
faults reach them like running requests.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from gateway import preemption
from gateway.request import Event, GenRequest, call_budget
from gateway.stubs import CONTRACT_CODES, client_status
from infra import tracing
from tandem.v1 import draft_pb2, target_pb2

SHARED_PROMPT_MIN = 32     # tokens: a shorter prompt's copies would wait a step for little or no cached block

if TYPE_CHECKING:
    from gateway.scheduler import Scheduler


def plan(s: Scheduler) -> list[tuple[GenRequest, int]]:
    """This step's Prefill: (request, max_chunk_tokens; 0: whole) per item. Admitted requests move from
    s.waiting to s.prefilling (until their last chunk)."""
    room = preemption.admission(s, s.max_batch - len(s.running) - len(s.prefilling))
    if s.max_num_batched_tokens <= 0:
        return _admit(s, [], room, None)
    left, out = s.max_num_batched_tokens, []
    for r in s.prefilling:                       # prompts partly prefilled first, oldest first
        if left <= 0:
            break
        n = min(left, len(r.context_ids) - r.prefilled)
        out.append((r, n))
        left -= n
    return _admit(s, out, room, left)


def admit_late(s: Scheduler, items: list[tuple[GenRequest, int]]) -> list[tuple[GenRequest, int]]:
    """--late-admission: requests that arrived after the step's plan (`items`, riding the round's Verify), while
    the round waited for its drafts, admitted into that Prefill as plan() would have, in the room and budget left
    -> the items added (moved from s.waiting to s.prefilling)."""
    room = preemption.admission(s, s.max_batch - len(s.running) - len(s.prefilling))
    left = None if s.max_num_batched_tokens <= 0 else \
        s.max_num_batched_tokens - sum(n or len(r.context_ids) - r.prefilled for r, n in items)
    return _admit(s, list(items), room, left)[len(items):]


def _admit(s: Scheduler, out: list, room: int, left: int | None) -> list[tuple[GenRequest, int]]:
    """Waiting requests into the step's Prefill `out` while `room` and `left` (positions; None: no budget, whole
    prompts) last -> out. Where the target caches prefixes, a copy of a prompt being prefilled (n > 1, or the same
    request twice) waits for that prefill, then finds the prompt in the caches: computed once, not n times."""
    i = 0
    while room > 0 and i < len(s.waiting) and (left is None or left > 0):
        r = s.waiting[i]
        if r.after is not None and not r.after.finished and r.after.prefilled < len(r.after.prompt_ids):
            i += 1                               # (behind it, others may go)
            continue
        if left is not None and r.prompt_logprobs and out and len(r.context_ids) > left:
            break                                # scored whole: it waits for a step of its own
        s.waiting.pop(i)
        _copies_wait(s, r)
        s.prefilling.append(r)
        room -= 1
        n = 0 if left is None or r.prompt_logprobs else min(left, len(r.context_ids))
        out.append((r, n))
        left = None if left is None else left - (n or len(r.context_ids))
    return out


def _copies_wait(s: Scheduler, r: GenRequest) -> None:
    """Where the target caches prefixes: the waiting copies of r's prompt wait for r's prefill (GenRequest.after)."""
    if s.share_prompts and len(r.prompt_ids) >= SHARED_PROMPT_MIN and not r.output_ids:
        for q in s.waiting:
            if q.after is None and not q.output_ids and q.prompt_ids == r.prompt_ids:
                q.after = r


def request(s: Scheduler, items: list[tuple[GenRequest, int]]) -> target_pb2.PrefillRequest:
    """The Prefill of `items` (from plan): alone, or riding the round's Verify (VerifyRequest.prefill)."""
    rows = any(s._speculating and (r.prefilled == 0 or r.draft.to_draft) for r, _ in items)
    return target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
        request_id=r.id, prompt_token_ids=r.context_ids, sampling=r.sampling, logprobs=r.logprobs,
        prompt_logprobs=r.prompt_logprobs, max_chunk_tokens=n) for r, n in items],
        return_hidden_rows=rows, transport=s.transport)


async def prefill(s: Scheduler, items: list[tuple[GenRequest, int]]) -> None:
    """One Prefill over `items` (from plan), then the chunk Propose of those still prefilling; the
    finished prompts join s.running with their first token."""
    reqs = [r for r, _ in items]
    req = request(s, items)
    t0 = time.perf_counter()
    s.feed = []
    try:
        with tracing.phase("prefill", [r.span for r in reqs], requests=len(reqs)):
            resp = await s.target.Prefill(req, timeout=call_budget(reqs, s.timeout)[0])
    except grpc.aio.AioRpcError as e:
        refused(s, reqs, e)
        return
    s.obs.phase("prefill", time.perf_counter() - t0)
    answered(s, reqs, resp)


def refused(s: Scheduler, reqs: list[GenRequest], e: grpc.aio.AioRpcError) -> None:
    """The target refused the Prefill of `reqs` (alone or riding a Verify): no room waits, else they fail."""
    failed = preemption.prefill_refused(s, reqs) if preemption.cache_full(e) else reqs
    if failed:
        s._target_failed(failed, e, "Prefill")


def unsent(s: Scheduler, items: list[tuple[GenRequest, int]], e: grpc.aio.AioRpcError) -> None:
    """The Verify they rode failed: new requests wait again at the head of the queue (the target kept nothing of
    them); a prompt begun stays begun where the target had no room (nothing of the step ran: the next step plans
    its chunk again), else it ends with the Verify's status (the target may have dropped it)."""
    for r, _ in reversed(items):
        if r.finished:
            continue
        if r.prefilled == 0 and r in s.prefilling:
            s.prefilling.remove(r)
            s.waiting.insert(0, r)
        elif not preemption.cache_full(e):
            s.fail(r, client_status(e), f"target Verify (with its prompt's chunk) failed: {e.details()}")


def rode(s: Scheduler, items: list[tuple[GenRequest, int]], vresp: target_pb2.VerifyResponse) -> None:
    """The answer of a Prefill that rode the round's Verify (VerifyRequest.prefill), or why the target refused it."""
    reqs, st = [r for r, _ in items], vresp.prefill_status
    s.mixed_prefills += 1
    if vresp.HasField("prefill") and not st.code:
        answered(s, reqs, vresp.prefill)
        return
    code = next((c for c in grpc.StatusCode if c.value[0] == st.code and st.code), grpc.StatusCode.INTERNAL)
    why = st.message if st.code else "the target answered the Verify without the Prefill it carried"
    refused(s, reqs, grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=why))


def answered(s: Scheduler, reqs: list[GenRequest], resp: target_pb2.PrefillResponse) -> None:
    """Apply a Prefill's answer: each request's chunk to its draft state, finished prompts to s.running."""
    if any(r.prefilled == 0 for r in reqs):
        preemption.prefill_fitted(s)
    rows = resp.hidden_rows
    for i, r in enumerate(reqs):
        context = r.context_ids
        end = resp.num_computed_tokens[i] if i < len(resp.num_computed_tokens) else len(context)
        done, tok = end >= len(context), resp.first_token_ids[i]
        tokens = list(context[r.prefilled + 1 if r.prefilled else 0:end + 1]) + ([tok] if done else [])
        if r.prefilled == 0:                     # the request's first call: a new request for the draft
            r.cached_tokens = resp.num_cached_tokens[i] if i < len(resp.num_cached_tokens) else 0
            r.draft.prefilled(tokens, rows, speculate=s._speculating and resp.HasField("hidden_rows"),
                              wants_drafts=s.draft is not None and r.k > 0, cached=r.cached_tokens)
        else:
            r.draft.verified(tokens, rows)
        r.prefilled = end
        if not done:
            if r.draft.to_draft and not r.cancelled:
                s.feed.append(r)
            continue
        if r.draft.prompt_only and not r.cancelled:     # its last chunk too: then the draft holds the prompt
            s.feed.append(r)
        s.prefilling.remove(r)
        lp = resp.logprobs[i] if i < len(resp.logprobs) else None
        r.prompt_lps = list(lp.prompt) if lp is not None else []
        if r.max_tokens <= 0:                    # scoring only (echo with max_tokens 0): no new token
            r.events.put_nowait(Event([], "", "length"))
            s._finish(r, "length")
            continue
        s.running.append(r)
        s._commit(r, [tok], [lp.first_token] if lp is not None and r.logprobs is not None else [])


def row_sets(reqs: list[GenRequest]) -> tuple[list, dict[int, int]]:
    """The row sets `reqs`' pending tokens are in, once each -> (a Propose's hidden_rows, id of a set -> its
    place there, from 1: each item names the set it reads, since another set may name the request too)."""
    sets = {id(r.draft.rows): r.draft.rows for r in reqs}
    return list(sets.values()), {key: i for i, key in enumerate(sets, 1)}


def feed_items(feed: list[GenRequest], index: dict[int, int]) -> list[draft_pb2.ProposeItem]:
    """The Propose items giving the draft the chunks pending in `feed`'s DraftStates: no drafts asked
    (index: id of a row set -> its place in the call's hidden_rows, from 1)."""
    return [draft_pb2.ProposeItem(request_id=r.id, new_token_ids=r.draft.pending, num_draft_tokens=0,
                                  sampling=r.sampling, position=r.draft.position, cached_tokens=r.draft.cached,
                                  rows_set=index[id(r.draft.rows)])
            for r in feed]


def fed(feed: list[GenRequest], results) -> None:
    """The draft answered the feed's items: it holds their chunks, or (not_held: its prefix cache lacked the
    target's hit) not the request, which is re-synced once running."""
    for r, res in zip(feed, results):
        if res.not_held:
            r.draft.lost()
        else:
            r.draft.proposed()
            if r.prefilled >= len(r.context_ids):
                r.draft.prompt_given()


async def feed_draft(s: Scheduler, feed: list[GenRequest]) -> None:
    """The step's chunks for the draft when the round made no Propose: a Propose of their own."""
    feed = [r for r in feed if r.draft.to_draft and not r.finished and not r.cancelled]
    if not feed:
        return
    sets, index = row_sets(feed)
    preq = draft_pb2.ProposeRequest(items=feed_items(feed, index), hidden_rows=sets, gateway_session=s.session)
    timeout, by_deadlines = call_budget(feed, s.draft_timeout)
    try:
        with tracing.phase("propose", [r.span for r in feed], requests=len(feed)):
            presp = await s.draft.Propose(preq, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() in CONTRACT_CODES:
            for r in feed:
                if r.draft.prompt_only:          # given for the draft's prefix cache only: it wants no drafts
                    r.draft.lost()
                else:
                    s.fail(r, client_status(e), f"draft Propose (prefill chunk): {e.details()}")
            return
        for r in feed:                           # unknown on the draft: re-synced once running
            r.draft.lost()
        if not (by_deadlines and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            s.draft_lost(f"draft Propose (prefill chunk) failed ({e.code().name}: {e.details()})",
                         restarted=client_status(e) == grpc.StatusCode.UNAVAILABLE)
        return
    s.avail.draft_proposed()
    fed(feed, presp.results)
