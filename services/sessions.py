"""Gateway sessions on the draft: which gateway holds each request, and when each gateway last called.

A draft request may legitimately go many rounds without a Propose (parked at k = 0 by the adaptive policy,
or waiting while its gateway decodes without drafts), so, unlike the target (services/target/engine.py idle),
the draft cannot tell an orphan by the request's own silence. It tells it by its gateway's: every gateway
process names a random session in its Proposes and, while none runs, in a GetInfo keepalive
(gateway/watch.py). A session silent for --request-idle-s is a gateway that is gone (SIGKILLed, its host
lost); its requests are released at the next Propose of any gateway, which is when their KV blocks are
wanted. Requests first proposed without a session (a target's push names none, tests' hand-made calls)
are never released for idleness."""
from __future__ import annotations

import threading
import time


class Sessions:
    def __init__(self, idle_s: float):
        self.idle_s = idle_s                    # 0: never release
        self.seen: dict[str, float] = {}        # session -> when it last called (monotonic)
        self.owner: dict[str, str] = {}         # request id -> the session it was first proposed under
        self._check_at = 0.0
        self._mu = threading.Lock()             # saw() runs on any handler thread

    def saw(self, session: str, request_ids=()) -> None:
        """`session` called now, naming `request_ids` (each kept under the first session that named it)."""
        if session and self.idle_s > 0:
            with self._mu:
                self.seen[session] = time.monotonic()
                for rid in request_ids:
                    self.owner.setdefault(rid, session)

    def gone(self, held) -> list[str]:
        """The held requests of sessions silent for idle_s (looked at every quarter of it, at most every
        minute; [] between looks). Forgets requests no longer held and the sessions it gives up."""
        now = time.monotonic()
        if self.idle_s <= 0 or now < self._check_at:
            return []
        self._check_at = now + min(60.0, self.idle_s / 4)
        with self._mu:
            self.owner = {rid: s for rid, s in self.owner.items() if rid in held}
            silent = {s for s, t in self.seen.items() if now - t > self.idle_s}
            for s in silent:
                del self.seen[s]
            return [rid for rid, s in self.owner.items() if s in silent]
