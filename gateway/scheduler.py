"""Continuous batching of speculative rounds: Prefill new requests, then Propose -> Verify -> commit.

While no prefill chunk or re-sync waits for the draft first, rounds overlap: the next round's Propose goes out
as soon as a Verify answers, before that round's commit (gateway/proposals.py). Requests join between rounds and
leave as they finish; with a token budget a long prompt is prefilled in chunks, one Prefill per step (gateway/
chunking.py). While requests run, a step's Prefill rides its round's Verify (VerifyRequest.prefill: one forward, so
new prompts do not cost the running batch another read of every weight); its requests join the next round, their
first drafts asked as soon as the Verify answers (proposals.join); with --late-admission, requests that arrive while
the round waits for its drafts join that Prefill (chunking.admit_late). Tokens are committed only from the target's
answers (gateway/ending.py). A draft that fails (other than
a contract error) costs speed, not tokens: its requests continue with zero drafts, speculation is degraded until
the draft answers again, and their draft cache is re-synced before it proposes for them again
(gateway/availability.py, gateway/resync.py). A contract error or a target failure ends every request of that
round with the service's status and message; a target that is UNAVAILABLE also refuses new requests.

Deadlines: a request past its deadline fails (DEADLINE_EXCEEDED) and is freed before the next round; a
call whose requests all carry deadlines is given no longer than the last of them. Each request's k: gateway/adaptive.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import grpc

from gateway import chunking, preemption, proposals
from gateway.adaptive import FixedPolicy
from gateway.availability import Availability, InFlight
from gateway.ending import Ending
from gateway.request import Event, GenRequest, Observer, SpecStats, call_budget  # noqa: F401 (re-exported)
from gateway.resync import resync
from gateway.stubs import DraftStub, TargetStub
from infra import tracing
from tandem.v1 import rows_pb2, target_pb2

log = logging.getLogger("tandem.gateway")


class Scheduler(Ending):
    """The rounds of one gateway. It reaches the services only through `target` and `draft` (None: no
    speculation), objects with the methods of gateway/stubs.py: grpc.aio stubs when serving, or
    in-process objects with the same async methods. `run()` loops forever; `step()` is one pass:
    expire, re-sync, one Prefill (newcomers, chunks), one round."""

    share_prompts = False      # the target caches prefixes: copies of a prompt wait for its prefill (chunking.py)
    early_propose = True       # a push may leave before the target reads its acceptance (proposals.plan_ahead)

    def __init__(self, target: TargetStub, draft: DraftStub | None, eos_ids: set[int], max_batch: int = 64,
                 rpc_timeout_s: float = 60.0, transport: int = rows_pb2.TRANSPORT_UNSPECIFIED,
                 observer: Observer | None = None, draft_timeout_s: float = 10.0, max_waiting: int = 0, policy=None,
                 max_num_batched_tokens: int = 0, overlap: bool = True, propose_ahead: bool = True,
                 mixed_prefill: bool = True, join_ahead: bool = True, late_admission: bool = False):
        self.target, self.draft, self.eos = target, draft, eos_ids
        self.obs, self.policy = observer or Observer(), policy or FixedPolicy()   # policy: gateway/adaptive.py
        self.max_batch, self.timeout, self.transport, self.draft_timeout = max_batch, rpc_timeout_s, transport, draft_timeout_s
        self.avail = Availability(draft is not None, max_waiting)
        self.waiting: list[GenRequest] = []
        self.feed: list[GenRequest] = []        # prefilling, their step's chunk not yet given to the draft
        self.prefilling: list[GenRequest] = []  # admitted, prompt not yet prefilled to its end (gateway/chunking.py)
        self.max_num_batched_tokens = max_num_batched_tokens   # prompt positions a step prefills; 0: whole
        self.running: list[GenRequest] = []
        self.stats = SpecStats()
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self.session = uuid.uuid4().hex        # this gateway process: the draft holds its requests while it calls
        self._prefix = self.session[:8]        # several gateways may share one target
        self._held: list[GenRequest] = []      # in the Prefill or round now awaiting the services (a round may
                                               # admit more: late_admission)
        self.inflight = InFlight()             # the Prefill, re-sync or round awaited now (target_lost cuts it)
        self.overlap = overlap                 # send the next round's Propose before committing (proposals.py)
        self.propose_ahead = propose_ahead     # ... from the target, named in the Verify (proposals.plan_ahead)
        self.join_ahead = join_ahead           # joiners' first Propose rides that push (proposals.join)
        self.late_admission = late_admission   # requests arriving while a round waits for its drafts ride its Verify
        self.mixed_prefill = mixed_prefill     # a step's Prefill rides its round's Verify (gateway/chunking.py)
        self.riding: list[tuple[GenRequest, int]] = []     # that Prefill's items, until the Verify carries them
        self.joined: proposals.Proposal | dict | None = None   # its requests' first Propose (or its drafts): next round
        self.ahead: proposals.Proposal | None = None       # that Propose, collected by the next round
        self.planned = False                               # the last round planned the next: nobody to send
        self.proposing: list[proposals.Proposal] = []      # Proposes not yet answered
        self._round_end, self._off_round = 0.0, 0.0        # the last round's end; calls between rounds since
        self.preemptions = self.freed = self.ahead_rounds = self.early_rounds = 0   # preempted, ended; pushes, early
        self.joins_ahead = 0                                    # joins computed in one pass with a push
        self.mixed_prefills = 0                                 # Prefills that rode a Verify
        self.late_admissions = 0                                # requests admitted into one while it waited
        self.admit_cap = self.admit_after = None           # admission's cap and hold (gateway/preemption.py)

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def submit(self, r: GenRequest) -> None:
        self.waiting.append(r)
        self._wake.set()

    def cancel(self, r: GenRequest) -> None:
        """Client gone: drop it from the queues and free its state in both services.

        A request held by the call now in flight is only marked, and finished when that call
        returns: a Release sent now could overtake its Prefill (leaving it on the target) or its
        Propose/Verify (failing the whole round with "not running")."""
        if r in self.waiting:
            self.waiting.remove(r)
            r.cancelled = True
            self.obs.finished(r, None, time.monotonic())
        elif not r.finished:
            r.cancelled = True
            if r not in self._held:
                self._finish(r, None)

    async def run(self) -> None:
        while True:
            if not self.waiting and not self.running and not self.prefilling:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
            except Exception:  # a bug must not kill the loop silently: fail the round, keep serving
                log.exception("round failed")
                for r in self.running + self.prefilling:
                    self.fail(r, grpc.StatusCode.INTERNAL, "internal error in the gateway round")

    # --- service faults (called by the rounds and by gateway/watch.py) ----------------------------
    def draft_lost(self, reason: str, restarted: bool = True) -> None:
        """The draft failed or went away: every running request decodes without drafts, and is re-synced
        before the draft proposes for it again. When the draft (or its bridge) is gone (restarted: an
        UNAVAILABLE), rows go inline until target and draft report the same new bridge generation
        (gateway/watch.py). A Propose that was only slow or lost its rows (DEADLINE_EXCEEDED,
        NOT_FOUND) keeps the bridge."""
        self.avail.draft_failed(reason)
        for r in self.running + self.prefilling:
            r.draft.lost()
        if self.transport != rows_pb2.TRANSPORT_INLINE and restarted:      # a slow draft keeps its bridge
            log.warning("hidden rows go inline until the bridge is rebuilt with the draft")
            self.transport = rows_pb2.TRANSPORT_INLINE

    def target_lost(self, reason: str) -> None:
        """Refuse new requests; the call in flight and every request fail now, not after their timeouts."""
        self.avail.target_failed(reason)
        self.inflight.cut(f"the target service is unavailable ({reason})")

    def _expire(self) -> None:
        """Fail (and free) requests past their deadline, or all while the target is down or the gateway stopped;
        none is in a call."""
        now, down = time.monotonic(), self.avail.failing_all()
        for r in self.waiting + self.prefilling + self.running:
            if down is not None:
                self.fail(r, grpc.StatusCode.UNAVAILABLE, down)
            elif r.deadline is not None and r.deadline <= now:
                self.fail(r, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        self.waiting = [r for r in self.waiting if not r.finished]

    async def step(self) -> None:
        self._expire()
        stale = [r for r in self.running if r.draft.stale]
        t0 = time.perf_counter()
        if stale and self.avail.degraded is None and self.ahead is None and not self.proposing:
            await self._holding(stale, resync(self, stale))   # (its Release must not overtake a Propose)
        items = chunking.plan(self) if self.waiting or self.prefilling else []
        self.riding = items if self.mixed_prefill and self.running else []    # one forward with the round's Verify
        if items and not self.riding:
            await proposals.settle_joined(self)
            await self._holding([r for r, _ in items], chunking.prefill(self, items))
        self._off_round += time.perf_counter() - t0
        if self.running:
            batch = list(self.running)
            await self._holding(batch + self.feed + [r for r, _ in self.riding], self._round(batch))
        if self.riding:                           # the round ended before its Verify: the prompts go alone
            items, self.riding = self.riding, []
            await proposals.settle_joined(self)
            await self._holding([r for r, _ in items], chunking.prefill(self, items))
        if self.feed:                             # the round made no Propose: the chunks go alone
            feed, self.feed = self.feed, []
            t0 = time.perf_counter()
            await self._holding(feed, chunking.feed_draft(self, feed))
            self._off_round += time.perf_counter() - t0

    async def _holding(self, reqs: list[GenRequest], call) -> None:
        """Await one Prefill, re-sync or round over `reqs` and those it admits late (cut short: they fail), then
        finish the cancelled."""
        self._held = list(reqs)
        try:
            cut = await self.inflight.run(call)        # why target_lost cut it short, or None
            for r in self._held if cut else []:
                self.fail(r, grpc.StatusCode.UNAVAILABLE, cut)
        finally:
            held, self._held = self._held, []
            for r in held:
                if r.cancelled and not r.finished:
                    self._finish(r, None)

    async def _round(self, batch: list[GenRequest]) -> None:
        """One speculative round over the running batch: Propose for the requests the draft speculates
        for (or collect the Propose the last round sent ahead: gateway/proposals.py), Verify every request
        (with no drafts for the others), commit the target's tokens."""
        ahead, self.ahead = self.ahead, None
        split = {"propose": 0.0, "transfer": 0.0, "draft_compute": 0.0}   # round split (metrics)
        if ahead is not None and not any(r.id in ahead.ids for r in batch):   # all finished since: unused
            await proposals.collect(self, ahead, [], dict(split))
            ahead = None
        round_t0 = time.perf_counter() if ahead is None else self._round_end + self._off_round
        drafts, planned, self.planned = {}, self.planned, False
        joined = set(self.joined) if isinstance(self.joined, dict) else self.joined.ids if self.joined else set()
        if ahead is None:           # the policy's own time is the gateway's part of the round
            # who goes to the draft, each with its k (GenRequest.round_k); planned at the end of the last
            # round already, with nobody to send, unless a request became synced since (prefilled, re-synced)
            live = [r for r in batch if r.id not in joined]
            spec = [] if planned and not any(r.draft.speculate for r in live) else self.policy.plan(live)
        else:
            drafts = await proposals.collect(self, ahead, batch, split)
            if drafts is None:
                return
            # requests prefilled since it was sent: their first Propose (the prompt), at the k the policy gives
            spec = [r for r in batch if r.draft.speculate and r.id not in ahead.ids and r.id not in joined]
            self.policy.joining(spec)
        more = await proposals.collect_joined(self, batch, split)
        if more is None:
            return
        drafts.update(more)
        if spec:
            feed, self.feed = [r for r in self.feed if r.draft.to_draft and not r.finished], []
            more = await proposals.collect(self, await proposals.send(self, spec, feed), batch, split)
            if more is None:
                return
            drafts.update(more)
        if self.late_admission and self.mixed_prefill and self.waiting:    # arrived while the drafts were computed
            self._admit_late()
        vreq = target_pb2.VerifyRequest(items=[proposals.verify_item(r, drafts.get(r.id)) for r in batch],
                                        return_hidden_rows=any(r.draft.speculate for r in batch), transport=self.transport)
        plan = proposals.plan_ahead(self, batch, drafts, vreq) if self._overlaps(batch) else None
        riding, self.riding = self.riding, []
        if riding:
            vreq.prefill.CopyFrom(chunking.request(self, riding))
        called = batch + [r for r, _ in riding]
        t0 = time.perf_counter()
        try:
            with tracing.phase("verify", [r.span for r in called], requests=len(batch)):
                vresp = await self.target.Verify(vreq, timeout=call_budget(called, self.timeout)[0])
        except grpc.aio.AioRpcError as e:
            chunking.unsent(self, riding, e)
            if not (preemption.cache_full(e) and preemption.preempt(self, batch)):
                self._target_failed(batch, e, "Verify")
            return
        split.update(verify=time.perf_counter() - t0, target_compute=vresp.timing.compute_seconds)
        proposals.hops(self.target.Verify, vresp.timing, split)
        # its new requests join the next round, their drafts asked now: first, riding the push that waits for them
        # (and before that push's collect takes the draft's lane), else after the commit
        ride = plan.message.ahead_id if riding and vresp.ahead_sent and plan.message.expect_join else ""
        if ride:
            await self._join(riding, vresp, ride)
        ks = [len(drafts[r.id].draft_token_ids) if r.id in drafts else 0 for r in batch]
        self.policy.record(ks)
        for r, res, k in zip(batch, vresp.results, ks):
            r.stats.add(k, res.num_accepted)
            self.stats.add(k, res.num_accepted)
            r.draft.verified(list(res.emitted_token_ids), vresp.hidden_rows)
            r.uncommitted = len(res.emitted_token_ids)
        overlap = self._overlaps(batch)
        if not overlap:
            self._commit_all(batch, vresp.results)
        self._close_round(batch, split, round_t0)
        if overlap or vresp.ahead_sent:     # the next round's drafts are computed while this round commits
            self.ahead = await proposals.after_verify(self, plan, vresp, batch)
            self.planned = self.ahead is None      # nobody to send: the next round needs no plan of its own
        if overlap:
            self._commit_all(batch, vresp.results)
        if riding and not ride:
            await self._join(riding, vresp)

    def _admit_late(self) -> None:
        """Waiting requests into the Prefill riding this round's Verify, held by the round like its own."""
        late = chunking.admit_late(self, self.riding)
        self.riding += late
        self.late_admissions += len(late)
        self._held += [r for r, _ in late]

    async def _join(self, riding: list[tuple[GenRequest, int]], vresp, ride: str = "") -> None:
        chunking.rode(self, riding, vresp)
        self.joined = await proposals.join(self, [r for r, _ in riding], ride)

    def _overlaps(self, batch: list[GenRequest]) -> bool:
        """Whether the next round's Propose goes out before this round commits: while the draft speculates
        and no prefill chunk or re-sync waits for it first. New requests are prefilled while that Propose
        runs; their first Propose (the prompt) follows in the round that collects it."""
        return self.overlap and self._speculating and not self.feed and not any(r.draft.stale for r in batch)

    def _close_round(self, batch: list[GenRequest], split: dict[str, float], round_t0: float) -> None:
        """The round's split (with rounds overlapped a round runs from the last one's end, less the Prefill
        and re-sync calls between them: the commit it hid behind its Propose is in it only as far as
        the Propose did not hide it) to the metrics and the policy."""
        self._round_end, self._off_round = time.perf_counter(), 0.0
        split["round"] = self._round_end - round_t0
        split["gateway"] = split["round"] - split["propose"] - split["verify"]
        self.obs.round_split(split)
        self.policy.observe(batch, split)

    @property
    def _speculating(self) -> bool:
        return self.draft is not None and self.avail.degraded is None
