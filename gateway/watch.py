"""The gateway watches the target and the draft: gRPC health every WATCH_INTERVAL_S and, while the
gateway holds a service for down, a GetInfo that must still describe the model the gateway started
with before the service counts as back (a restarted target of another model stays down).

A check that fails UNAVAILABLE (nothing listens: the process crashed or is restarting) puts the
service down at once; no answer within CHECK_TIMEOUT_S (1 s) only after MISSES (3) in a row. The
services answer health on threads of their own (infra/grpc_server.py), so a busy engine does not
delay it: a process that misses three 1 s deadlines is hung (SIGSTOPped, swapped out, deadlocked in
C), not slow. A target that hangs is therefore down at most 0.5 + 3 x 1 + 2 x 0.5 = 4.5 s after its
last answer (the watch sleeps WATCH_INTERVAL_S between checks), and the requests it held fail then
(gateway/availability.py). The gateway's client channels retry a lost connection at least every
second (RECONNECT_OPTIONS; gRPC's default backoff grows to two minutes), so a restarted service is
seen about a second after it serves.

Hidden rows go back on the bridge after a draft restart (`watch_bridge`) once target and draft report
the same connected transport and bridge generation in GetInfo (services/bridge/generations.py).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import common_pb2, rows_pb2

log = logging.getLogger("tandem.gateway")
WATCH_INTERVAL_S = 0.5
CHECK_TIMEOUT_S = 1.0
MISSES = 3
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
LOAD_FIELDS = {"kv_blocks_total", "kv_blocks_free", "running_requests",     # may differ after a restart
               "hidden_transport", "bridge_generation", "prefix_cache_queries", "prefix_cache_hits", "local_lane",
               "request_idle_s"}


def info_changes(before: common_pb2.InfoResponse, now: common_pb2.InfoResponse) -> list[str]:
    """The fields of two GetInfo answers that differ, other than the load-dependent ones."""
    a, b = (MessageToDict(m, preserving_proto_field_name=True) for m in (before, now))
    return [f"{k}: was {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in LOAD_FIELDS and a.get(k) != b.get(k)]


class ServiceWatch:
    """Polls one service. `is_down()`: whether the gateway holds it for down now (set by this watch
    or by a failed call); `on_down(reason)` / `on_up()`: report what a check found. `info` None: the
    service has not answered since the gateway started; its first GetInfo must pass `first(info)` (-> the
    differences from what the gateway serves, [] when none) and is then the reference."""

    def __init__(self, name: str, channel: grpc.aio.Channel, stub, info: common_pb2.InfoResponse | None,
                 is_down, on_down, on_up, interval_s: float = WATCH_INTERVAL_S, first=None, session: str = ""):
        self.name, self.stub, self.info, self.first = name, stub, info, first
        self.session, self._keep_at = session, 0.0      # the draft's keepalive of this gateway's session
        self.health = health_pb2_grpc.HealthStub(channel)
        self.is_down, self.on_down, self.on_up, self.interval_s = is_down, on_down, on_up, interval_s

    async def run(self) -> None:
        misses = 0
        while True:
            try:
                why, hard = await self._check()
                misses = 0 if why is None else misses + 1
                if why is not None and (hard or misses >= MISSES):
                    self.on_down(why)
                elif why is None and not self.is_down():
                    await self._keepalive()
                elif why is None:
                    changed = await self._changed()
                    if changed is None:
                        self.on_up()
                    elif changed:
                        self.on_down(f"{self.name} came back serving another model ({'; '.join(changed)})")
            except Exception:                    # the watch must outlive any surprise
                log.exception("watching the %s failed", self.name)
            await asyncio.sleep(self.interval_s)

    async def _check(self) -> tuple[str | None, bool]:
        """-> (None, _) when SERVING, else (why, whether it is certainly down)."""
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return f"{self.name} health check: {e.code().name}: {e.details()}", e.code() == grpc.StatusCode.UNAVAILABLE
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return f"{self.name} health: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}", True
        return None, False

    async def _keepalive(self) -> None:
        """GetInfo naming this gateway's session every quarter of the service's --request-idle-s (at most every
        30 s): the draft releases the requests of a session silent that long (services/sessions.py), and a
        request parked at k = 0 sees no Propose for as long as it runs."""
        idle = self.info.request_idle_s if self.info is not None else 0.0
        now = asyncio.get_running_loop().time()
        if not self.session or idle <= 0 or now < self._keep_at:
            return
        self._keep_at = now + min(30.0, idle / 4)
        try:
            await self.stub.GetInfo(common_pb2.InfoRequest(gateway_session=self.session), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            self._keep_at = now                           # the next check tries again

    async def _changed(self) -> list[str] | None:
        """None: the same model as at start; a list of differences; [] when GetInfo failed (retry)."""
        try:
            now = await self.stub.GetInfo(common_pb2.InfoRequest(gateway_session=self.session), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return []
        changes = info_changes(self.info, now) if self.info is not None else self.first(now)
        if changes:
            log.error("%s came back serving another model: %s", self.name, "; ".join(changes))
        elif self.info is None:
            self.info = now
        return changes or None


async def watch_bridge(scheduler, target, draft, wanted: int, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Put hidden rows back on the bridge (`wanted`: the configured transport) once speculation is active
    and target and draft report the same connected transport and generation: both ends of one new
    bridge (a draft that restarted joined the next generation and the target paired with it)."""
    while True:
        await asyncio.sleep(interval_s)
        if scheduler.transport == wanted or scheduler.avail.degraded is not None:
            continue
        try:
            t, d = await asyncio.gather(*(s.GetInfo(common_pb2.InfoRequest(), timeout=CHECK_TIMEOUT_S)
                                          for s in (target, draft)))
        except grpc.aio.AioRpcError:
            continue
        if t.hidden_transport and (t.hidden_transport, t.bridge_generation) == (d.hidden_transport,
                                                                                d.bridge_generation):
            log.info("hidden rows go on the bridge again (%s, generation %d)", t.hidden_transport, t.bridge_generation)
            scheduler.transport = wanted


def start(scheduler, target: tuple, draft: tuple | None, mismatch=None) -> list[asyncio.Task]:
    """Watch tasks for the target and (when speculating) the draft; each tuple is (channel, stub,
    its GetInfo at start: None for a draft that did not serve then, whose first GetInfo must pass
    `mismatch(info)` -> [] (gateway/server.py model_mismatch)). A lost draft degrades speculation (scheduler.draft_lost) and one that
    answers again resumes it; a lost target refuses new requests until it is back. With a bridge
    configured (the scheduler's transport now), rows return to it after a draft restart."""
    av = scheduler.avail
    tasks = [asyncio.ensure_future(ServiceWatch("target", *target, lambda: av.target_down is not None,
                                                scheduler.target_lost, av.target_answers).run())]
    if draft is not None:
        tasks.append(asyncio.ensure_future(ServiceWatch("draft", *draft, lambda: av.degraded is not None,
                                                        scheduler.draft_lost, av.draft_answers,
                                                        first=mismatch, session=scheduler.session).run()))
        if scheduler.transport != rows_pb2.TRANSPORT_INLINE:
            tasks.append(asyncio.ensure_future(watch_bridge(scheduler, target[1], draft[1], scheduler.transport)))
    return tasks
