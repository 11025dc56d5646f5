"""`tandem serve`'s restart policy for the processes it runs.

A process that exits while the cluster runs is started again with the same command after a backoff
(BASE_S, doubling up to CAP_S), at most `max_restarts` times within WINDOW_S; past that the whole
cluster stops (a service that keeps crashing is a fault to show, not to hide). Every exit and
restart is logged on stderr. The gateway survives a restart of the target or the draft: it fails
the requests that were running on a crashed target, refuses new ones until the target answers
again, and serves without drafts until the draft is back (gateway/availability.py).

A process that hangs without exiting (SIGSTOPped, deadlocked outside Python) is found by its own
health probe (HangProbe, for the target and the draft once they serve): PROBE_MISSES (3) checks in a
row without an answer within PROBE_TIMEOUT_S (2 s), PROBE_INTERVAL_S (1 s) apart, i.e. at most
1 + 3 x 2 + 2 x 1 = 9 s after its last answer; it is then SIGKILLed and restarted like a crash. (The
gateway, with its 1 s deadline, has already failed the requests it held by then: gateway/watch.py.)
A refused connection is not a miss: the process is starting, or gone, which its exit shows.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra.defaults import DIE_WITH_PARENT

BASE_S = 1.0
CAP_S = 30.0
WINDOW_S = 600.0
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
PROBE_MISSES = 3
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
             ("grpc.max_reconnect_backoff_ms", 1000)]     # see a restarted process within a second


def log(msg: str) -> None:
    print(f"tandem: {msg}", file=sys.stderr, flush=True)



class HangProbe:
    """Checks one service's gRPC health every PROBE_INTERVAL_S on a thread of its own; `hung` says why
    once PROBE_MISSES checks in a row missed their deadline."""

    def __init__(self, name: str, addr: str, tls=None):
        from infra import tls as tls_mod
        self.stub = health_pb2_grpc.HealthStub(tls_mod.channel(addr, tls or tls_mod.PLAINTEXT, options=RECONNECT))
        self.name, self.misses, self.hung = name, 0, None
        threading.Thread(target=self._run, daemon=True, name=f"probe-{name}").start()

    def _run(self) -> None:
        while True:
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                self.misses = 0
            except grpc.RpcError as e:          # only silence counts; refused or NOT_SERVING is no hang
                self.misses = self.misses + 1 if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else 0
            if self.misses >= PROBE_MISSES and self.hung is None:
                self.hung = f"did not answer {self.misses} health checks in a row within {PROBE_TIMEOUT_S:.0f}s each"
            time.sleep(PROBE_INTERVAL_S)

    def reset(self) -> None:
        self.misses, self.hung = 0, None


class Supervisor:
    def __init__(self, commands: list[tuple[str, list[str]]], env: dict, max_restarts: int = 5):
        self.commands = dict(commands)
        self.env, self.max_restarts = env, max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, list[float]] = defaultdict(list)     # name -> restart times
        self.probes: dict[str, HangProbe] = {}

    def start(self, name: str) -> subprocess.Popen:
        p = self.procs[name] = subprocess.Popen(self.commands[name], env={**self.env, DIE_WITH_PARENT: "1"})
        log(f"started {name} (pid {p.pid})")
        if name in self.probes:
            self.probes[name].reset()
        return p

    def probe(self, name: str, addr: str, tls=None) -> None:
        """From now on, restart `name` also when it hangs (its gRPC health at `addr` stops answering)."""
        self.probes[name] = HangProbe(name, addr, tls)

    def check(self, stopping) -> bool:
        """Restart what exited or hung; False when a process exhausted its restarts (stop the cluster).
        `stopping()`: the user asked to stop (cuts a backoff short)."""
        for name, p in list(self.procs.items()):
            if p.poll() is None and not self._killed_hung(name, p):
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

    def _killed_hung(self, name: str, p: subprocess.Popen) -> bool:
        """SIGKILL a process its probe found hung (it is then restarted like a crash); whether it did."""
        probe = self.probes.get(name)
        if probe is None or probe.hung is None:
            return False
        log(f"{name} (pid {p.pid}) {probe.hung}: it is hung; killing it (SIGKILL) to restart it")
        p.kill()
        p.wait()
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

    def stop(self, grace_s: float = 10.0, first: str = "gateway", first_grace_s: float = 40.0) -> None:
        """SIGTERM to `first` (the gateway: it drains its requests, which need the services) and wait for it (at most
        first_grace_s), then to the others; kill what remains after grace_s."""
        items = list(reversed(self.procs.items()))
        groups = [[(n, p) for n, p in items if n == first], [(n, p) for n, p in items if n != first]]
        for group, wait_s in zip(groups, (first_grace_s, grace_s)):
            running = [(name, p) for name, p in group if p.poll() is None]
            for _, p in running:
                p.terminate()
            for name, p in running:
                try:
                    code = p.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    log(f"{name} did not stop within {wait_s:.0f}s of SIGTERM: killing it")
                    p.kill()
                    continue
                if code not in (0, -signal.SIGTERM):
                    log(f"{name} exited with code {code} while stopping")
