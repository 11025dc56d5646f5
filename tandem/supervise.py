"""`tandem serve`'s restart policy for the processes it runs.

A process that exits while the cluster runs is started again with the same command after a backoff
(BASE_S, doubling up to CAP_S), at most `max_restarts` times within WINDOW_S; past that the whole
cluster stops (a service that keeps crashing is a fault to show, not to hide). Every exit and
restart is logged on stderr. The gateway survives a restart of the target or the draft: it fails
the requests that were running on a crashed target, refuses new ones until the target answers
again, and serves without drafts until the draft is back (gateway/availability.py).
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict

BASE_S = 1.0
CAP_S = 30.0
WINDOW_S = 600.0


def log(msg: str) -> None:
    print(f"tandem: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, commands: list[tuple[str, list[str]]], env: dict, max_restarts: int = 5):
        self.commands = dict(commands)
        self.env, self.max_restarts = env, max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, list[float]] = defaultdict(list)     # name -> restart times

    def start(self, name: str) -> subprocess.Popen:
        p = self.procs[name] = subprocess.Popen(self.commands[name], env=self.env)
        log(f"started {name} (pid {p.pid})")
        return p

    def check(self, stopping) -> bool:
        """Restart what exited; False when a process exhausted its restarts (stop the cluster).
        `stopping()`: the user asked to stop (cuts a backoff short)."""
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            delay = self._backoff(name, p.returncode)
            if delay is None:
                return False
            end = time.monotonic() + delay
            while time.monotonic() < end:
                if stopping():
                    return True
                time.sleep(0.1)
            self.start(name)
        return True

    def _backoff(self, name: str, code: int) -> float | None:
        now = time.monotonic()
        recent = self.restarts[name] = [t for t in self.restarts[name] if now - t < WINDOW_S]
        if len(recent) >= self.max_restarts:
            log(f"{name} exited with code {code}; it was restarted {len(recent)} times in the last "
                f"{WINDOW_S:.0f}s (--max-restarts {self.max_restarts}): stopping")
            return None
        delay = min(CAP_S, BASE_S * 2 ** len(recent))
        recent.append(now + delay)
        log(f"{name} exited with code {code}; restarting it in {delay:.0f}s "
            f"(restart {len(recent)} of at most {self.max_restarts} in {WINDOW_S:.0f}s)")
        return delay

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to all (gateway first: it holds the services' clients), then kill what remains."""
        procs = list(reversed(self.procs.values()))
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
