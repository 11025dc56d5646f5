"""gRPC server plumbing shared by the target and draft services: health, reflection, limits,
status mapping and a clean stop on SIGINT/SIGTERM. (No torch here: the gateway may use it too.)"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from infra.defaults import DIE_WITH_PARENT

log = logging.getLogger("tandem.grpc")
MAX_MESSAGE_BYTES = 256 << 20


def channel_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


def server_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """A server's: no SO_REUSEPORT (gRPC's default on Linux), so a port another process serves fails to bind
    instead of being shared, which split one cluster's clients with another's."""
    return channel_options(max_bytes) + [("grpc.so_reuseport", 0)]


def bind(server, host: str, port: int, tls, flag: str, **kw) -> int:
    """Listen on host:port -> the bound port; SystemExit naming the port and `flag` when it cannot."""
    from infra import tls as tls_mod
    try:
        bound = tls_mod.add_port(server, f"{host}:{port}", tls or tls_mod.PLAINTEXT, **kw)
    except RuntimeError:                              # grpcio >= 1.60 raises where older ones returned 0
        bound = 0
    if not bound:
        raise SystemExit(f"cannot bind the gRPC port {host}:{port} (in use by another process?); choose another "
                         f"with {flag}")
    return bound


class HealthServicer(health.HealthServicer):
    """gRPC health whose Check runs on threads of its own (gRPC's per-method pool), not the server's
    workers: those may all wait for the engine lock behind a long step, and the gateway and `tandem
    serve` read a health check that misses its deadline as a hung process."""

    def Check(self, request, context):
        return super().Check(request, context)


HealthServicer.Check.experimental_thread_pool = futures.ThreadPoolExecutor(max_workers=2,
                                                                            thread_name_prefix="health")


STOP_BACKSTOP_S = 20.0      # a target or draft still stopping this long after its signal ends itself (serve)
STOP_POLL_S = 0.25          # how late a stop signal that landed on another thread may be seen


def serve(register, service_names: list[str], host: str, port: int, workers: int = 4,
          max_bytes: int = MAX_MESSAGE_BYTES, tls=None) -> None:
    """Start a server with `register(server)`'s servicers plus health and reflection; block until
    SIGINT/SIGTERM, then mark NOT_SERVING and stop with a grace period. `tls` (infra.tls.TlsFiles):
    listen with TLS, and with its CA require client certificates (mutual TLS)."""
    from infra import tracing
    # The stop signals' handler takes no lock: Python runs it in the main thread between two of its bytecodes, which
    # may be inside the very lock it would take, in the handler before it (a threading.Event's: a draft deadlocked in
    # Event.set under the repeated death signal of a SIGKILLed `tandem serve`; tests/test_shutdown.py). Installed
    # before the server starts, so a stop that comes while it starts is a clean stop too.
    stop: list[int] = []
    for sig in stop_signals():
        signal.signal(sig, lambda signum, _: stop.append(signum))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(max_bytes),
                         interceptors=[InternalErrors()] + tracing.server_interceptors())
    register(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    bound = bind(server, host, port, tls, "--grpc-port (under `tandem serve`: --target-port or --draft-port)")
    server.start()
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), host, bound,
             "mutual TLS" if tls and tls.ca else "TLS" if tls and tls.cert else "plaintext")
    # The kernel may deliver a signal to any thread that does not block it, and Python runs its handler only when
    # the main thread runs again: an untimed wait there never woke to run it (CI: a target in futex_do_wait 30 s
    # after its SIGTERM). So the main thread sleeps in short steps, and under `tandem serve` it watches its parent
    # too, so that a death signal that never ran stops it all the same.
    parent = os.getppid() if os.environ.get(DIE_WITH_PARENT) == "1" else None
    while not stop:
        if parent is not None and os.getppid() != parent:
            log.warning("the process that started this one (pid %d) has exited; stopping", parent)
            break
        time.sleep(STOP_POLL_S)
    # a stop that hangs anyway would hold its ports for good: past STOP_BACKSTOP_S every thread's stack goes to
    # the log and the process exits 1
    faulthandler.dump_traceback_later(STOP_BACKSTOP_S, exit=True)
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2).wait()
    log.info("stopped")


def stop_signals() -> tuple[signal.Signals, ...]:
    """SIGINT and SIGTERM; only SIGTERM under `tandem serve` (DIE_WITH_PARENT), whose Ctrl-C reaches every
    process of the terminal's group at once: the supervisor stops them in order (the gateway drains first)."""
    supervised = os.environ.get(DIE_WITH_PARENT) == "1"
    return (signal.SIGTERM,) if supervised else (signal.SIGINT, signal.SIGTERM)


class InternalErrors(grpc.ServerInterceptor):
    """A handler's unexpected exception (a CUDA out-of-memory, a bug) ends the call INTERNAL, naming the
    method and the error, with the traceback in this service's log: gRPC's own answer would be UNKNOWN
    ("Exception calling application" / "Exception iterating responses"), which says nothing. A call the
    handler aborted itself (context.abort: its code is set) keeps its status; a call whose client went away
    (a cancelled stream's request iterator raises grpc.RpcError) is no fault of the service: it ends quietly."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return handler
        method = details.method.lstrip("/")

        def fail(context, e: Exception):
            if context.code() is not None:          # context.abort already chose the status
                raise e
            if isinstance(e, grpc.RpcError) and not context.is_active():
                log.debug("%s: the client went away (%s)", method, type(e).__name__)
                return
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, internal_details(method, e))

        def wrap(inner, streaming: bool):
            if inner is None:
                return None
            if streaming:
                def behavior(request, context):
                    try:
                        yield from inner(request, context)
                    except Exception as e:
                        fail(context, e)
            else:
                def behavior(request, context):
                    try:
                        return inner(request, context)
                    except Exception as e:
                        fail(context, e)
            pool = getattr(inner, "experimental_thread_pool", None)   # a stream's own threads (servicer.py)
            if pool is not None:
                behavior.experimental_thread_pool = pool
            return behavior
        return handler._replace(unary_unary=wrap(handler.unary_unary, False),
                                unary_stream=wrap(handler.unary_stream, True),
                                stream_unary=wrap(handler.stream_unary, False),
                                stream_stream=wrap(handler.stream_stream, True))


def internal_details(method: str, e: Exception) -> str:
    """An unexpected exception's INTERNAL details, the same on a gRPC call and a local lane (services/lane.py)."""
    return f"{method}: internal error in the service ({type(e).__name__}: {e})"[:2000]


def abort(context, code: str, message: str):
    context.abort(getattr(grpc.StatusCode, code), message)


def time_left(context) -> float | None:
    """Seconds until the caller's deadline (None: it set none). A call whose deadline has passed
    before it ran is refused with DEADLINE_EXCEEDED: nobody waits for its answer, and work done
    after the caller gave up (a Prefill's cache) would be state nobody releases."""
    left = context.time_remaining()
    if left is not None and left <= 0:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed before the call ran; "
                                                         "nothing was done")
    return left
