"""Proposes pushed a round ahead (issue 14): the target sends the next round's Propose as soon as its Verify
has the tokens and rows (ProposeRequest.ahead_id), the gateway collects the answer (collect_ahead_id).

Requests whose prompts rode that Verify join with their first Propose, which the gateway sends as the Verify
answers. Computed after the push, it would be a second chain of draft steps on the next round's critical path; so a
push whose Verify announced it (expect_join) and that Propose (ride_ahead_id) meet here (`Joins`), and the push
computes both in one pass.

The draft keeps each pushed Propose's outcome, its ProposeResponse or its ServiceError, under the id until the
gateway collects it. A push is registered as it arrives, before it waits for the draft's lock, so a collect
that comes first waits for it. A collect of an id never pushed waits only GRACE_S (the target pushes before it
answers the Verify, so a push that is coming is in this process already) and is NOT_FOUND. Outcomes nobody
collects (the gateway went away, the requests finished) are dropped after KEEP_S, the oldest first past MAX_KEPT.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from infra.errors import ServiceError

GRACE_S = 2.0
PUSH_WAIT_S = 0.1          # a push expecting its join waits this long for it (the gateway sends it as the Verify
#                           answers, ~0.5 ms later; the target's lane to the draft, every gateway's pushes, waits too)
JOIN_WAIT_S = 1.0          # a join waits this long for its push (only its own gateway's lane waits with it)
KEEP_S = 120.0
MAX_KEPT = 256
PENDING = object()


class AheadStore:
    def __init__(self):
        self._cond = threading.Condition()
        self._kept: dict[str, tuple[float, object]] = {}       # id -> (when, PENDING | response | ServiceError)

    def pushed(self, ahead_id: str) -> None:
        """A push arrived: its id is known from now on, its outcome to come."""
        with self._cond:
            self._drop_old()
            self._kept[ahead_id] = (time.monotonic(), PENDING)

    def done(self, ahead_id: str, outcome) -> None:
        """The push's ProposeResponse, or the ServiceError it failed with."""
        with self._cond:
            self._kept[ahead_id] = (time.monotonic(), outcome)
            self._cond.notify_all()

    def collect(self, ahead_id: str, timeout_s: float):
        """-> the outcome of push `ahead_id` (removed), waiting up to timeout_s for it; ServiceError NOT_FOUND
        when none arrived within GRACE_S, DEADLINE_EXCEEDED when it arrived but did not finish in time."""
        end, grace = time.monotonic() + timeout_s, time.monotonic() + min(GRACE_S, timeout_s)
        with self._cond:
            while True:
                got = self._kept.get(ahead_id)
                if got is not None and got[1] is not PENDING:
                    del self._kept[ahead_id]
                    return got[1]
                now = time.monotonic()
                if got is None and now >= grace:
                    raise ServiceError("NOT_FOUND", f"the Propose pushed ahead as {ahead_id!r} never reached this "
                                       "draft (the target could not send it, or this draft restarted since)")
                if now >= end:
                    raise ServiceError("DEADLINE_EXCEEDED", f"the Propose pushed ahead as {ahead_id!r} did not "
                                       f"finish within {timeout_s:.3g} s")
                self._cond.wait(min(end, grace if got is None else end) - now)

    def _drop_old(self) -> None:
        now = time.monotonic()
        for key in [key for key, (t, _) in self._kept.items() if now - t > KEEP_S]:
            del self._kept[key]
        while len(self._kept) >= MAX_KEPT:
            del self._kept[next(iter(self._kept))]

    def __len__(self) -> int:
        with self._cond:
            return len(self._kept)


@dataclass(eq=False)
class Join:
    """A Propose riding a push (ride_ahead_id), taken by that push's pass, which answers it (`outcome`: its
    ProposeResponse or ServiceError, then `answered` is set)."""
    request: object
    taken: bool = False
    outcome: object = None
    answered: threading.Event = field(default_factory=threading.Event)


class Joins:
    """Where a push that expects a join and the join meet, whichever comes first waiting for the other (a push up
    to PUSH_WAIT_S, a join up to JOIN_WAIT_S). Met: the push's pass computes both. Not met in time: each computes
    alone, and the id is closed, so a late one does not wait (the last MAX_KEPT ids are remembered)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: dict[str, Join] = {}                      # ahead id -> its join, not yet taken
        self._closed: OrderedDict[str, None] = OrderedDict()     # ids met or given up

    def meet(self, ahead_id: str) -> Join | None:
        """The push's side: -> the join riding it, now taken (the caller computes it and answers it), or None."""
        end = time.monotonic() + PUSH_WAIT_S
        with self._cond:
            while ahead_id not in self._waiting and ahead_id not in self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            join = self._waiting.pop(ahead_id, None)
            self._close(ahead_id)
            if join is not None:
                join.taken = True
                self._cond.notify_all()
            return join

    def ride(self, ahead_id: str, request) -> Join | None:
        """The join's side: -> its Join once the push took it (wait for `answered`), or None: compute it alone."""
        end = time.monotonic() + JOIN_WAIT_S
        with self._cond:
            if ahead_id in self._closed:
                return None
            if ahead_id in self._waiting:
                raise ServiceError("INVALID_ARGUMENT", f"ride_ahead_id: {ahead_id!r} is named by another Propose "
                                   "already; a push takes one join")
            join = self._waiting[ahead_id] = Join(request)
            self._cond.notify_all()
            while not join.taken:
                left = end - time.monotonic()
                if left <= 0:
                    del self._waiting[ahead_id]
                    self._close(ahead_id)
                    return None
                self._cond.wait(left)
            return join

    def _close(self, ahead_id: str) -> None:
        self._closed[ahead_id] = None
        while len(self._closed) > MAX_KEPT:
            self._closed.popitem(last=False)
