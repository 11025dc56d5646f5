"""Proposes pushed a round ahead (issue 14): the target sends the next round's Propose as soon as its Verify
has the tokens and rows (ProposeRequest.ahead_id), the gateway collects the answer (collect_ahead_id).

The draft keeps each pushed Propose's outcome, its ProposeResponse or its ServiceError, under the id until the
gateway collects it. A push is registered as it arrives, before it waits for the draft's lock, so a collect
that comes first waits for it. A collect of an id never pushed waits only GRACE_S (the target pushes before it
answers the Verify, so a push that is coming is in this process already) and is NOT_FOUND. Outcomes nobody
collects (the gateway went away, the requests finished) are dropped after KEEP_S, the oldest first past MAX_KEPT.
"""
from __future__ import annotations

import threading
import time

from infra.errors import ServiceError

GRACE_S = 2.0
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
