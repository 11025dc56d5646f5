"""What the gateway knows about its services' availability, and the rules that follow from it.

Draft: active, or degraded (a Propose failed other than by a contract error, or its health check
did). While degraded every request decodes without drafts (tokens come from the target only, so
nothing is lost) and the scheduler marks each running request stale: the draft's cache of it is
lost or unknown. Speculation resumes once the draft answers health again, but not before a backoff
since it degraded (doubling with each degradation up to BACKOFF_MAX_S, reset by a Propose that
succeeds): a draft that answers health yet fails every Propose must not stall each round for its
timeout. Stale requests
are re-synced before the draft proposes for them again (gateway/resync.py).

Target: up, or down (a call failed UNAVAILABLE, or its health check did: refused, or no answer within
its deadline several times in a row, gateway/watch.py). While down new requests are refused at once
(HTTP 503 / gRPC UNAVAILABLE) instead of queued, and every request the gateway holds fails at once
with UNAVAILABLE: the call in flight is cut short (InFlight) rather than left to wait out its timeout
on a target that stopped answering without exiting (its connection stays open). It is up again once
its health says SERVING and its GetInfo still describes the model this gateway started with.

Back-pressure: at most `max_waiting` requests queue for a Prefill; beyond it new ones are refused
(HTTP 429 / gRPC RESOURCE_EXHAUSTED).

Shutdown (gateway/drain.py): while the gateway drains, new requests are refused (503 / UNAVAILABLE) and those
it holds run on; once it stops, those left fail with UNAVAILABLE, as when the target is down.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

log = logging.getLogger("tandem.gateway")
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


class Availability:
    def __init__(self, has_draft: bool, max_waiting: int = 0):
        self.has_draft, self.max_waiting = has_draft, max_waiting
        self.degraded: str | None = None        # why speculation is off; None: active (or no draft)
        self.degraded_since = 0.0
        self.retry_at = 0.0                     # monotonic; no resume before it
        self.backoff_s = BACKOFF_START_S
        self.target_down: str | None = None     # why the target is unavailable; None: up
        self.draft_failures = 0                 # times speculation became degraded
        self.resynced = 0                       # requests whose draft cache was rebuilt
        self.rejected: Counter = Counter()      # refused at admission, by reason
        self.on_target: list = []               # f(up: bool) on each change (the gateway's gRPC health mirrors it)
        self.stopping: str | None = None        # why new requests are refused: the gateway drains (gateway/drain.py)
        self.stopped = False                    # ... and now fails those it still holds

    # --- draft ----------------------------------------------------------------------------------
    def draft_failed(self, reason: str) -> None:
        """Degrade (or stay degraded: only the reason changes, the resume time does not move)."""
        if self.degraded is None:
            now = time.monotonic()
            self.draft_failures += 1
            self.degraded_since, self.retry_at = now, now + self.backoff_s
            self.backoff_s = min(BACKOFF_MAX_S, self.backoff_s * 2)
            log.warning("speculation degraded: %s; decoding without drafts until the draft answers again", reason)
        self.degraded = reason

    def draft_proposed(self) -> None:
        """A Propose succeeded: the next failure backs off from the start again."""
        self.backoff_s = BACKOFF_START_S

    def draft_answers(self) -> None:
        """The draft's health says SERVING (and its info is unchanged): resume after the backoff."""
        if self.degraded is not None and time.monotonic() >= self.retry_at:
            log.info("the draft answers again after %.1fs degraded: re-syncing running requests, then "
                     "speculating again", time.monotonic() - self.degraded_since)
            self.degraded = None

    def speculation(self) -> dict:
        """The state for /health."""
        if not self.has_draft:
            return {"state": "off"}
        if self.degraded is None:
            return {"state": "active"}
        return {"state": "degraded", "reason": self.degraded,
                "seconds": round(time.monotonic() - self.degraded_since, 1)}

    # --- target ---------------------------------------------------------------------------------
    def target_failed(self, reason: str) -> None:
        if self.target_down is None:
            log.error("target unavailable: %s; refusing new requests until it answers again", reason)
            self.target_down = reason
            for f in self.on_target:
                f(False)
        self.target_down = reason

    def target_answers(self) -> None:
        if self.target_down is not None:
            log.info("target answers again: accepting requests")
            self.target_down = None
            for f in self.on_target:
                f(True)

    def failing_all(self) -> str | None:
        """Why every request held must fail now (the target is down, the gateway stopped), or None."""
        if self.target_down is not None:
            return f"the target service is unavailable ({self.target_down})"
        return self.stopping if self.stopped else None

    # --- admission ------------------------------------------------------------------------------
    def admit(self, n: int, waiting: int) -> tuple[grpc.StatusCode, str] | None:
        """None when n new requests may queue behind `waiting`, else the status to refuse them with."""
        if self.stopping is not None:
            self.rejected["shutting_down"] += n
            return grpc.StatusCode.UNAVAILABLE, f"{self.stopping}; retry on another replica or later"
        if self.target_down is not None:
            self.rejected["target_unavailable"] += n
            return grpc.StatusCode.UNAVAILABLE, f"the target service is unavailable ({self.target_down}); retry later"
        if self.max_waiting and waiting + n > self.max_waiting:
            self.rejected["queue_full"] += n
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (f"too many requests queued: {waiting} waiting, the limit "
                                                        f"is {self.max_waiting} (--max-waiting); retry later")
        return None


class InFlight:
    """The one Prefill, re-sync or round the scheduler awaits at a time, kept so that `cut` can end it
    (gRPC cancels its RPC) when the target is found down."""

    def __init__(self):
        self._task: asyncio.Future | None = None
        self._cut: str | None = None              # why the call in flight was cut short

    async def run(self, call) -> str | None:
        """Await `call` -> None, or why `cut` ended it first."""
        task = self._task = asyncio.ensure_future(call)
        try:
            await task
            return None
        except asyncio.CancelledError:
            if self._cut is None:
                raise                              # the gateway itself is stopping
            return self._cut
        finally:
            self._task, self._cut = None, None

    def cut(self, reason: str) -> bool:
        """End the call in flight now; False when there is none."""
        if self._task is None or self._task.done():
            return False
        self._cut = reason
        self._task.cancel()
        return True
