"""gRPC server plumbing shared by the target and draft services: health, reflection, limits,
status mapping and a clean stop on SIGINT/SIGTERM. (No torch here: the gateway may use it too.)"""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("tandem.grpc")
MAX_MESSAGE_BYTES = 256 << 20


def channel_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


class HealthServicer(health.HealthServicer):
    """gRPC health whose Check runs on threads of its own (gRPC's per-method pool), not the server's
    workers: those may all wait for the engine lock behind a long step, and the gateway and `tandem
    serve` read a health check that misses its deadline as a hung process."""

    def Check(self, request, context):
        return super().Check(request, context)


HealthServicer.Check.experimental_thread_pool = futures.ThreadPoolExecutor(max_workers=2,
                                                                            thread_name_prefix="health")


def serve(register, service_names: list[str], host: str, port: int, workers: int = 4,
          max_bytes: int = MAX_MESSAGE_BYTES, tls=None) -> None:
    """Start a server with `register(server)`'s servicers plus health and reflection; block until
    SIGINT/SIGTERM, then mark NOT_SERVING and stop with a grace period. `tls` (infra.tls.TlsFiles):
    listen with TLS, and with its CA require client certificates (mutual TLS)."""
    from infra import tls as tls_mod, tracing
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=channel_options(max_bytes),
                         interceptors=tracing.server_interceptors())
    register(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    bound = tls_mod.add_port(server, f"{host}:{port}", tls or tls_mod.PLAINTEXT)
    if not bound:
        raise SystemExit(f"cannot bind {host}:{port}")
    server.start()
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), host, bound,
             "mutual TLS" if tls and tls.ca else "TLS" if tls and tls.cert else "plaintext")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2).wait()
    log.info("stopped")


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
