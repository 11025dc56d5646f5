"""Continuous batching of speculative rounds: Prefill new requests, then Propose -> Verify -> commit.

Requests join between rounds and leave as they finish. Tokens are committed only from the
target's answers. A draft that fails (other than a contract error) costs speed, not tokens: its
requests continue with zero drafts. A contract error or a target failure ends every request of
that round with the service's status and message.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from gateway.text import TextStream
from tandem import tracing
from tandem.v1 import draft_pb2, rows_pb2, target_pb2

log = logging.getLogger("tandem.gateway")
CONTRACT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Event:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None      # "stop" | "length" | None
    error: tuple[grpc.StatusCode, str] | None = None
    logprobs: list = field(default_factory=list)   # target_pb2.TokenLogprob per token, when asked


class Observer:
    """Hooks for metrics (gateway/metrics.py); the base does nothing."""

    def phase(self, name: str, seconds: float) -> None:
        """A round phase took `seconds`: prefill | propose | transfer | verify."""

    def tokens(self, r: "GenRequest", n: int, now: float) -> None:
        """`n` new tokens were committed for r (before r.first_token_time / last_token_time move)."""

    def finished(self, r: "GenRequest", reason: str | None, now: float) -> None:
        """r ended: "stop" | "length", or None (failed or cancelled)."""


@dataclass
class GenRequest:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: rows_pb2.SamplingParams
    text: TextStream
    ignore_eos: bool = False
    k: int = 0                                               # draft tokens per round
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    speculate: bool = True
    draft_tokens: list[int] = field(default_factory=list)   # committed, not yet given to the draft
    draft_position: int = 0                                  # index of draft_tokens[0]
    rows: rows_pb2.HiddenRows | None = None                  # the row set holding their rows
    finished: bool = False
    cancelled: bool = False                                  # client gone while a call held it
    arrival: float = field(default_factory=time.monotonic)
    logprobs: int | None = None                              # top-n per output token; None: none
    prompt_logprobs: bool = False                            # score the prompt (echo + logprobs)
    prompt_lps: list = field(default_factory=list)           # TokenLogprob for prompt tokens 1..T-1
    span: object = None                                      # the client request's tracing span
    eos: tuple | None = None                                 # (EOS id, its TokenLogprob) when EOS ended it
    first_token_time: float | None = None
    last_token_time: float | None = None


class Scheduler:
    def __init__(self, target, draft, eos_ids: set[int], max_batch: int = 64, rpc_timeout_s: float = 60.0,
                 transport: int = rows_pb2.TRANSPORT_UNSPECIFIED, observer: Observer | None = None):
        self.target, self.draft, self.eos = target, draft, eos_ids
        self.obs = observer or Observer()
        self.max_batch, self.timeout, self.transport = max_batch, rpc_timeout_s, transport
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.stats = SpecStats()
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]    # several gateways may share one target
        self._in_flight: set[str] = set()      # ids in the Prefill or round now awaiting the services

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
        elif not r.finished:
            r.cancelled = True
            if r.id not in self._in_flight:
                self._finish(r, None)

    async def run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
            except Exception:  # a bug must not kill the loop silently: fail the round, keep serving
                log.exception("round failed")
                for r in list(self.running):
                    self._fail(r, grpc.StatusCode.INTERNAL, "internal error in the gateway round")

    async def step(self) -> None:
        room = self.max_batch - len(self.running)
        if self.waiting and room > 0:
            new, self.waiting = self.waiting[:room], self.waiting[room:]
            await self._holding(new, self._prefill(new))
        if self.running:
            batch = list(self.running)
            await self._holding(batch, self._round(batch))

    async def _holding(self, reqs: list[GenRequest], call) -> None:
        """Await one Prefill or round over `reqs`; then finish those cancelled meanwhile."""
        self._in_flight = {r.id for r in reqs}
        try:
            await call
        finally:
            self._in_flight = set()
            for r in reqs:
                if r.cancelled and not r.finished:
                    self._finish(r, None)

    async def _prefill(self, new: list[GenRequest]) -> None:
        req = target_pb2.PrefillRequest(
            items=[target_pb2.PrefillItem(request_id=r.id, prompt_token_ids=r.prompt_ids, sampling=r.sampling,
                                          logprobs=r.logprobs, prompt_logprobs=r.prompt_logprobs)
                   for r in new], return_hidden_rows=self.draft is not None and any(r.k > 0 for r in new), transport=self.transport)
        t0 = time.perf_counter()
        try:
            with tracing.phase("prefill", [r.span for r in new], requests=len(new)):
                resp = await self.target.Prefill(req, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            for r in new:
                self._fail(r, e.code(), f"target Prefill failed: {e.details()}")
            return
        self.obs.phase("prefill", time.perf_counter() - t0)
        for i, (r, tok) in enumerate(zip(new, resp.first_token_ids)):
            lp = resp.logprobs[i] if i < len(resp.logprobs) else None
            r.prompt_lps = list(lp.prompt) if lp is not None else []
            if r.max_tokens <= 0:             # scoring only (echo with max_tokens 0): no new token
                r.events.put_nowait(Event([], "", "length"))
                self._finish(r, "length")
                continue
            self.running.append(r)
            r.speculate = self.draft is not None and r.k > 0
            r.draft_tokens, r.draft_position, r.rows = list(r.prompt_ids) + [tok], 0, resp.hidden_rows
            self._commit(r, [tok], [lp.first_token] if lp is not None and r.logprobs is not None else [])

    async def _round(self, batch: list[GenRequest]) -> None:
        drafts: dict[str, draft_pb2.ProposeResult] = {}
        spec = [r for r in batch if r.speculate]
        if spec:
            sets = {id(r.rows): r.rows for r in spec}
            preq = draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id=r.id, new_token_ids=r.draft_tokens, num_draft_tokens=r.k, sampling=r.sampling,
                position=r.draft_position) for r in spec], hidden_rows=list(sets.values()))
            t0 = time.perf_counter()
            try:
                with tracing.phase("propose", [r.span for r in spec], requests=len(spec)):
                    presp = await self.draft.Propose(preq, timeout=self.timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in CONTRACT_CODES:
                    for r in batch:
                        self._fail(r, e.code(), f"draft Propose: {e.details()}")
                    return
                log.warning("draft Propose failed (%s: %s); %d requests continue without drafts",
                            e.code().name, e.details(), len(spec))
                for r in spec:
                    r.speculate = False
                asyncio.ensure_future(self._release(self.draft, [r.id for r in spec]))
            else:
                self.obs.phase("propose", time.perf_counter() - t0 - presp.transfer_seconds)
                self.obs.phase("transfer", presp.transfer_seconds)
                for r, res in zip(spec, presp.results):
                    drafts[r.id] = res
                    r.draft_position += len(r.draft_tokens)
                    r.draft_tokens, r.rows = [], None
        vreq = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            request_id=r.id, draft_token_ids=drafts[r.id].draft_token_ids if r.id in drafts else [],
            draft_probs=drafts[r.id].draft_probs if r.id in drafts else b"", logprobs=r.logprobs) for r in batch],
            return_hidden_rows=any(r.speculate for r in batch), transport=self.transport)
        t0 = time.perf_counter()
        try:
            with tracing.phase("verify", [r.span for r in batch], requests=len(batch)):
                vresp = await self.target.Verify(vreq, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            for r in batch:
                self._fail(r, e.code(), f"target Verify failed: {e.details()}")
            return
        self.obs.phase("verify", time.perf_counter() - t0)
        for r, res in zip(batch, vresp.results):
            k = len(drafts[r.id].draft_token_ids) if r.id in drafts else 0
            r.stats.add(k, res.num_accepted)
            self.stats.add(k, res.num_accepted)
            if r.speculate:
                r.draft_tokens, r.rows = list(res.emitted_token_ids), vresp.hidden_rows
            self._commit(r, list(res.emitted_token_ids), list(res.logprobs))

    def _commit(self, r: GenRequest, tokens: list[int], logprobs: list | None = None) -> None:
        """Commit the target's tokens in order up to the first that ends the request (EOS, one that
        completes a stop string, max_tokens): nothing after it is returned, so the completion
        (tokens, usage) does not depend on how many drafts a round accepted."""
        if r.finished:
            return
        new, text, finish, stopped = [], "", None, False
        for i, t in enumerate(tokens):
            if not r.ignore_eos and t in self.eos:
                finish = "stop"
                r.eos = (t, logprobs[i] if logprobs and i < len(logprobs) else None)
                break
            new.append(t)
            delta, stopped = r.text.add([t])
            text += delta
            if stopped:
                finish = "stop"
                break
            if len(r.output_ids) + len(new) >= r.max_tokens:
                finish = "length"
                break
        r.output_ids += new
        if finish and not stopped:
            text += r.text.flush()
        now = time.monotonic()
        self.obs.tokens(r, len(new), now)
        r.first_token_time = r.first_token_time or now
        r.last_token_time = now
        r.events.put_nowait(Event(new, text, finish, logprobs=list(logprobs or [])[:len(new)]))
        if finish:
            self._finish(r, finish)

    def _finish(self, r: GenRequest, reason: str | None) -> None:
        r.finished = True
        self.obs.finished(r, reason, time.monotonic())
        if r in self.running:
            self.running.remove(r)
        asyncio.ensure_future(self._release(self.target, [r.id]))
        if self.draft is not None:
            asyncio.ensure_future(self._release(self.draft, [r.id]))

    def _fail(self, r: GenRequest, code: grpc.StatusCode, message: str) -> None:
        if not r.finished:
            r.events.put_nowait(Event([], "", error=(code, message)))
            self._finish(r, None)

    async def _release(self, stub, ids: list[str]) -> None:
        try:
            await stub.Release(target_pb2.ReleaseRequest(request_ids=ids), timeout=10)
        except grpc.aio.AioRpcError as e:
            log.warning("Release of %s failed: %s", ids, e.code().name)
