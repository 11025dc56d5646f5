"""The draft's Propose of a round, sent when the round starts or, overlapped (issue 14), as soon as the
previous round's Verify has answered, or sent by the target itself a round ahead.

Sequential round: plan -> Propose -> Verify -> commit. Overlapped round: the Verify's answer carries each
request's emitted tokens and the hidden rows the draft needs, so the gateway plans the next round and sends
its Propose before it commits (detokenizes, checks stop strings, streams) this one; the draft computes while
the gateway commits, and the next round starts by collecting the drafts. A request whose pending tokens reach
max_tokens or the context's end, or hold an EOS, is left out of it (GenRequest.ends_at_commit); one that the
commit finishes otherwise (a stop string: known only once detokenized) was proposed for in vain: its draft Release waits until that Propose has
answered (a Release must never overtake a Propose that names the request: the draft would fail the call as
"not running").

A round ahead (issue 14, where the gateway reaches both services' local lanes): the gateway plans the next
round before this round's Verify, which names that work (`plan_ahead`: who, with which k, from which position);
the target sends the draft that Propose, with the Verify's tokens and row set, as soon as it has them, and the
gateway's Propose only collects its answer (`after_verify`). The draft computes while the Verify's answer travels
and the gateway commits: one hop and the gateway's planning off the round's critical path. A push the target
could not send (VerifyResponse.ahead_sent false) is sent by the gateway as above; a collect that fails follows
a Propose's fault rules.

After a Prefill that rode the round's Verify (gateway/chunking.py), the joining requests' first Propose and the
prompts' feeds go out together as the Verify answers (`join`: the prefill's row set is taken once), collected by the
next round (`collect_joined`), or before a later chunk's answer is applied outside a round (`settle_joined`).

`send` starts the call and returns a Proposal; `collect` awaits it and applies the answer, with the fault
rules of a Propose (gateway/scheduler.py's docstring): a contract error fails the round's requests, any
other failure costs only their drafts (re-synced later), and a new request the draft's prefix cache lacked
is recovered in the same round (gateway/prefix_recovery.py).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from gateway import chunking
from gateway.lanes import Lane
from gateway.prefix_recovery import recover
from gateway.request import call_budget
from gateway.stubs import CONTRACT_CODES, client_status
from infra import tracing
from tandem.v1 import draft_pb2, target_pb2

if TYPE_CHECKING:
    from gateway.request import GenRequest
    from gateway.scheduler import Scheduler


@dataclass(eq=False)
class Proposal:
    spec: list[GenRequest]          # the requests drafted for, each with its round_k() at send time
    feed: list[GenRequest]          # prefill chunks given to the draft in the same call (no drafts)
    task: asyncio.Future            # the Propose call
    by_deadlines: bool              # its timeout came from the requests' deadlines
    ids: set[str] = field(default_factory=set)
    deferred: list[str] = field(default_factory=list)   # finished meanwhile: draft Release once it answers


async def send(s: Scheduler, spec: list[GenRequest], feed: list[GenRequest], ride: str = "") -> Proposal:
    """Send the Propose of `spec` (their pending tokens and rows, k = round_k()) and `feed`'s chunks (riding the
    push `ride`: `join`); returns once the request is on its way (a lane's `begin`: written to the stream), its
    answer still to come."""
    sets, index = chunking.row_sets(spec + feed)
    preq = draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
        request_id=r.id, new_token_ids=r.draft.pending, num_draft_tokens=r.round_k(), sampling=r.sampling,
        position=r.draft.position, cached_tokens=r.draft.cached, rows_set=index[id(r.draft.rows)])
        for r in spec] + chunking.feed_items(feed, index), hidden_rows=sets, ride_ahead_id=ride,
        gateway_session=s.session)
    timeout, by_deadlines = call_budget(spec, s.draft_timeout)
    begin = getattr(s.draft.Propose, "begin", None)      # gateway/lanes.py; other stubs start on the next turn
    sent = asyncio.get_running_loop().create_future()

    async def call():
        with tracing.phase("propose", [r.span for r in spec], requests=len(spec)):   # (the call carries it)
            try:
                answer = await begin(preq, timeout=timeout) if begin else asyncio.ensure_future(
                    s.draft.Propose(preq, timeout=timeout))
            finally:
                if not sent.done():
                    sent.set_result(None)
            return await answer

    p = Proposal(spec, feed, asyncio.ensure_future(call()), by_deadlines, {r.id for r in spec + feed})
    s.proposing.append(p)
    p.task.add_done_callback(lambda _: _answered(s, p))
    if getattr(s.draft.Propose, "inline", False):   # computes when run (tandem/inprocess.py): it starts where
        return p                                     # the round collects it, not before the commit
    await asyncio.wait([sent, p.task], return_when=asyncio.FIRST_COMPLETED)   # on its way
    if begin is None:
        await asyncio.sleep(0)          # a unary call starts on the loop's next turn
    return p


@dataclass(eq=False)
class AheadPlan:
    """The next round's draft work, planned before this round's Verify (overlapped rounds)."""
    spec: list[GenRequest]                            # the policy's plan: who goes to the draft, with round_k()
    message: target_pb2.ProposeAhead | None = None    # the Propose the target sends (None: the gateway sends it)


def plan_ahead(s: Scheduler, batch: list[GenRequest], drafts: dict, vreq: target_pb2.VerifyRequest) -> AheadPlan | None:
    """Where the gateway reaches both services' local lanes (so they share its host and network namespace): plan
    the next round now, before this round's Verify, which names that work (VerifyRequest.ahead), and the target
    sends its Propose to the draft as soon as it has the tokens and rows. Each request's k counts this Verify's
    tokens at their most (its drafts + 1): only near the end of the context is it less than after. None: no
    lanes, the next round is planned once the Verify has answered."""
    lane = getattr(s.draft.Propose, "lane", "") if s.propose_ahead else ""
    if not (lane and getattr(s.target.Verify, "lane", "")):
        return None
    live = [r for r in batch if not r.cancelled]
    plan = AheadPlan(s.policy.plan(live) if live else [])
    if not plan.spec:
        return plan
    items = []
    for r in plan.spec:
        most = len(r.prompt_ids) + len(r.output_ids) + len(getattr(drafts.get(r.id), "draft_token_ids", ())) + 1
        k = min(r.round_k(), r.max_model_len - most)
        if k < 1 or r.draft.pending or r.draft.position == 0:     # (tokens the Verify does not carry)
            return plan
        items.append(target_pb2.AheadItem(request_id=r.id, num_draft_tokens=k, position=r.draft.position))
    join = s.join_ahead and bool(s.riding)                                   # (a join rides it: sent after)
    plan.message = target_pb2.ProposeAhead(ahead_id=f"{s.new_id()}-ahead", draft_lane=lane, items=items,
                                           expect_join=join, early=s.early_propose and not join)
    vreq.ahead.CopyFrom(plan.message)
    return plan


async def after_verify(s: Scheduler, plan: AheadPlan | None, vresp, batch: list[GenRequest]) -> Proposal | None:
    """The next round's Propose once the Verify has answered: collected where the target sent it (ahead_sent),
    else sent now for the requests the commit does not end (known before it: max_tokens, the context's end,
    an EOS), as planned before the Verify or, without a plan, planned now."""
    if vresp.ahead_sent:
        named = {it.request_id for it in plan.message.items}
        spec = [r for r in plan.spec if r.id in named]
        preq = draft_pb2.ProposeRequest(collect_ahead_id=plan.message.ahead_id, gateway_session=s.session)
        timeout, by_deadlines = call_budget(spec, s.draft_timeout)

        async def call():
            with tracing.phase("propose", [r.span for r in spec], requests=len(spec), ahead=True):
                return await s.draft.Propose(preq, timeout=timeout)
        p = Proposal(spec, [], asyncio.ensure_future(call()), by_deadlines, named)
        s.proposing.append(p)
        p.task.add_done_callback(lambda _: _answered(s, p))
        s.ahead_rounds += 1
        s.early_rounds += vresp.ahead_early
        return p
    ends = {r.id for r, res in zip(batch, vresp.results) if r.ends_at_commit or not r.ignore_eos
            and not s.eos.isdisjoint(res.emitted_token_ids)}
    live = [r for r in s.running if not (r.cancelled or r.id in ends)]
    spec = [r for r in plan.spec if r in live] if plan is not None else s.policy.plan(live) if live else []
    return await send(s, spec, []) if spec else None


async def join(s: Scheduler, reqs: list[GenRequest], ride: str = "") -> Proposal | None:
    """After a Prefill that rode the round's Verify (gateway/chunking.py): its row set goes to the draft in ONE
    Propose, sent now: the prompts prefilled to their end that speculate (their first drafts, collected by the next
    round: `collect_joined`) and the chunks or prompt-only feeds (no drafts). A row set is taken once, so they cannot
    wait for two different calls. `ride`: the id of the push that Verify sent expecting this Propose (expect_join):
    the draft computes both in one pass; sent even with no items, as the push waits for it."""
    new = [r for r in reqs if r in s.running and r.draft.speculate and not r.cancelled]
    feed, s.feed = [r for r in s.feed if r.draft.to_draft and not r.finished], []
    if not (new or feed or ride):
        return None
    s.policy.joining(new)
    return await send(s, new, feed, ride)


async def collect_joined(s: Scheduler, batch: list[GenRequest], split: dict[str, float]) -> dict | None:
    """The drafts of the Propose `join` sent after the last round ({} when there is none), as `collect`."""
    p, s.joined = s.joined, None
    if isinstance(p, dict):                     # collected already (settle_joined)
        return p
    return {} if p is None else await collect(s, p, batch, split)


async def settle_joined(s: Scheduler) -> None:
    """Before a Prefill's answer is applied outside a round (a Prefill of its own: nobody running, or the round
    ended before its Verify), the Propose `join` sent is collected: the chunks it gave the draft count first (else a
    request's next chunk would replace the pending one). Its drafts wait for the next round."""
    if isinstance(s.joined, Proposal):
        p = s.joined
        s.joined = await collect(s, p, list(p.spec), {"propose": 0.0, "transfer": 0.0, "draft_compute": 0.0}) or {}


def _answered(s: Scheduler, p: Proposal) -> None:
    """The call is over (answered, failed or cancelled): release what finished while it ran."""
    s.proposing.remove(p)
    if not p.task.cancelled():
        p.task.exception()              # retrieved here; collect() raises it again where it is awaited
    if p.deferred:
        asyncio.ensure_future(s._release(s.draft, p.deferred))


def holds(s: Scheduler, rid: str) -> Proposal | None:
    """The unanswered Propose that names request `rid`, if any."""
    return next((p for p in s.proposing if rid in p.ids), None)


async def collect(s: Scheduler, p: Proposal, batch: list[GenRequest],
                  split: dict[str, float]) -> dict[str, draft_pb2.ProposeResult] | None:
    """Await `p`; -> the drafts by request id ({} when the Propose failed: no drafts this round; None when
    the draft answered with a contract error: every request of the round has failed with it)."""
    t0 = time.perf_counter()
    try:
        presp = await p.task
    except grpc.aio.AioRpcError as e:
        if e.code() in CONTRACT_CODES:
            for r in batch + p.feed:
                s.fail(r, client_status(e), f"draft Propose: {e.details()}")
            return None
        split["propose"] += time.perf_counter() - t0     # a failed Propose's wall is not the gateway's
        for r in p.spec + p.feed:          # the draft's state of them is unknown: re-sync later
            r.draft.lost()
        if not (p.by_deadlines and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):   # else: they expire
            s.draft_lost(f"draft Propose failed ({e.code().name}: {e.details()})",
                         restarted=client_status(e) == grpc.StatusCode.UNAVAILABLE)
        return {}
    s.avail.draft_proposed()
    split["propose"] += time.perf_counter() - t0
    if presp.computed_with_ahead_id:            # one pass with a push: its timing counts once, at that collect
        s.joins_ahead += 1
    else:
        hops(s.draft.Propose, presp.timing, split)
        split["transfer"] += presp.timing.transfer_seconds
        split["draft_compute"] += presp.timing.compute_seconds
    drafts = {}
    results = list(presp.results)
    chunking.fed(p.feed, results[len(p.spec):])
    for r, res in zip(p.spec, results):
        drafts[r.id] = res
        if not res.not_held:
            r.draft.proposed()
    lacked = [r for r, res in zip(p.spec, results) if res.not_held and not r.finished]
    if lacked:                                  # its prefix cache lacked what the target had
        await recover(s, lacked, drafts)
    return drafts


def hops(method, timing, split: dict[str, float]) -> None:
    """A streamed call's one-way hops (gateway/lanes.py Lane.legs) into the round's split, where known:
    rpc_request (written -> the service's handler has it), rpc_response (built -> read by the gateway), and
    rpc_service (the handler's time around its timed work: lock, parsing, checks, the response)."""
    legs = method.legs(timing) if isinstance(method, Lane) else None
    if legs is not None:
        around = timing.answered_at - timing.received_at - timing.compute_seconds - timing.transfer_seconds
        for name, v in zip(("rpc_request", "rpc_response", "rpc_service"), (*legs, max(0.0, around))):
            split[name] = split.get(name, 0.0) + v


def verify_item(r: GenRequest, res: draft_pb2.ProposeResult | None) -> target_pb2.VerifyItem:
    """r's item of the round's Verify: its drafts and the distributions they were drawn from, as the draft sent
    them (none, whole or sparse: draft.proto), or no drafts."""
    if res is None:
        return target_pb2.VerifyItem(request_id=r.id, logprobs=r.logprobs)
    return target_pb2.VerifyItem(request_id=r.id, draft_token_ids=res.draft_token_ids, draft_probs=res.draft_probs,
                                 draft_top_ids=res.draft_top_ids, draft_top_probs=res.draft_top_probs,
                                 logprobs=r.logprobs)
