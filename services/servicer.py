"""What the target and the draft answer alike: GetInfo (the InfoResponse the gateway compares), Release, and
the hello their bridge exchanges."""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

from infra import grpc_server, tracing
from infra.errors import ServiceError
from services import profiling
from services.bridge.rows import CONTRACT_VERSION
from services.lane import LaneServer
from services.config import ServiceConfig
from services.identity import model_identity
from tandem.v1 import common_pb2

log = logging.getLogger("tandem.servicer")


def service_info(cfg: ServiceConfig, engine, running: int, channel=None, lane: str = ""):
    """The InfoResponse both services answer GetInfo with (the gateway checks they agree); `channel`: the
    service's end of the hidden-row bridge (None: inline rows only); `lane`: its local lane's name (services/lane.py)."""
    mc = engine.model.cfg
    transport, generation = channel.state() if channel is not None else ("", 0)
    reserved = getattr(engine.forward, "reserved_blocks", 0)     # CUDA graphs' scratch block: no request's
    return common_pb2.InfoResponse(
        model=cfg.model, vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        eos_token_ids=list(mc.eos_token_ids), max_model_len=engine.max_model_len,
        kv_blocks_total=engine.cache.num_blocks - reserved, kv_blocks_free=engine.cache.num_free_blocks,
        running_requests=running, contract_version=CONTRACT_VERSION,
        num_nextn_predict_layers=mc.num_nextn_predict_layers, model_identity=model_identity(cfg.model),
        index_topk=mc.index_topk or 0, index_scoring=engine.cache.index_scoring or "",
        hidden_transport=transport, bridge_generation=generation, prefix_caching=engine.cache.pool.enabled,
        prefix_cache_queries=engine.cache.pool.queries, prefix_cache_hits=engine.cache.pool.hits, local_lane=lane,
        request_idle_s=cfg.request_idle_s)


def hello(cfg: ServiceConfig) -> dict:
    """What target and draft exchange when their bridge connects (and report in GetInfo)."""
    return {"model_identity": model_identity(cfg.model), "contract_version": CONTRACT_VERSION}


def answer(method: str, one, request, context, received: float):
    """One round call answered by the unary handler `one`, as a stream or a local lane runs it: traced,
    profiled (services/profiling.py), stamped when the request was had (`received`) and answered."""
    with tracing.server_span(method, request.trace_context), profiling.call(method):
        resp = one(request, context)
    resp.timing.received_at, resp.timing.answered_at = received, time.perf_counter()
    return resp


# The threads a persistent stream (ProposeStream, VerifyStream) holds for its lifetime, one per gateway: not
# the server's workers, which unary calls (Prefill, Release, GetInfo) need free.
STREAM_THREADS = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="stream")


class EngineLock:
    """One step at a time: the engine owns the cache. A Release that finds a step running is not waited for: its
    ids are released as that step lets go of the engine. (Waiting, Releases held the server's few workers behind a
    long forward, so GetInfo starved and health said the target was unreachable, and those past their deadline were
    dropped: the requests and their KV blocks stayed held for good.)"""

    def __init__(self, release):
        self._lock, self._mu = threading.Lock(), threading.Lock()
        self._release, self._deferred = release, []      # release(ids) -> how many were held; runs under the lock

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        try:
            self._drain()
        finally:
            self._lock.release()
            self._settle()

    def release(self, ids: list[str]) -> tuple[int, int]:
        """-> (released now, deferred to the end of the step running)."""
        if self._lock.acquire(blocking=False):
            try:
                return self._release(ids), 0
            finally:
                self._lock.release()
                self._settle()
        with self._mu:
            self._deferred += ids
        self._settle()                        # the step may have ended between the try and the append
        return 0, len(ids)

    def _settle(self) -> None:
        """Deferred ids left after the lock was let go (appended while its holder drained): released now, unless
        another holder has the lock (it drains them as it lets go)."""
        while self._deferred and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while True:
            with self._mu:
                ids, self._deferred = self._deferred, []
            if not ids:
                return
            try:
                self._release(ids)
            except ServiceError as e:         # the rank group broke: the service is exiting to be restarted
                log.warning("deferred Release of %d requests failed: %s", len(ids), e)


class ServicerBase:
    """Release and GetInfo, answered alike by the target and the draft. A subclass sets cfg, group and engine,
    and lock = EngineLock(self.release_now), and says how many requests it is running."""
    lane_server: LaneServer | None = None     # its local lane, once open_lane ran

    def running(self) -> int:
        raise NotImplementedError

    def release_now(self, ids: list[str]) -> int:
        return self.group.call(type(self.engine).release, ids)

    def Release(self, request, context):
        try:
            released, deferred = self.lock.release(list(request.request_ids))
            return common_pb2.ReleaseResponse(released=released, deferred=deferred)
        except ServiceError as e:             # the rank group broke: UNAVAILABLE, not a traceback
            grpc_server.abort(context, e.code, str(e))

    def _stream(self, requests, context):
        """ProposeStream / VerifyStream: each message answered by the round call's unary handler (`lane()`) in
        order; a failure aborts the stream with that call's status. A message that arrives after the caller gave
        up (the stream cancelled) is not run."""
        method, _, one = self.lane()
        for request in requests:
            received = time.perf_counter()          # CLOCK_MONOTONIC on Linux: one clock for the host
            if not context.is_active():
                return
            yield answer(method, one, request, context, received)

    def lane(self) -> tuple[str, type, object]:
        """The round call, which the stream and the local lane (services/lane.py) serve: (method, request class,
        unary handler)."""
        raise NotImplementedError

    def lane_spins_after(self, request) -> bool:
        """Whether the lane's reader polls without sleeping after this call (the next on its connection is urgent)."""
        return True

    def open_lane(self, spin_s: float, max_bytes: int) -> LaneServer | None:
        """Serve the round call on a local lane too (None: this host has no abstract Unix sockets: gRPC only)."""
        method, request_cls, one = self.lane()
        try:
            self.lane_server = LaneServer(method, request_cls, lambda req, ctx, received: answer(
                method, one, req, ctx, received), spin_s, max_bytes, getattr(self, "lane_spins_after", None))
        except OSError as e:
            log.warning("no local lane for %s (%s): round calls come over gRPC", method, e)
        return self.lane_server

    def GetInfo(self, request, context):
        if self.group.broken:                 # exiting to be restarted: not back for a gateway's check
            grpc_server.abort(context, "UNAVAILABLE", self.group.broken)
        return service_info(self.cfg, self.engine, self.running(), getattr(self, "channel", None),
                            self.lane_server.name if self.lane_server is not None else "")
