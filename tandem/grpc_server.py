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


def serve(register, service_names: list[str], host: str, port: int, workers: int = 4,
          max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Start a server with `register(server)`'s servicers plus health and reflection; block until
    SIGINT/SIGTERM, then mark NOT_SERVING and stop with a grace period."""
    from tandem import tracing
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=channel_options(max_bytes),
                         interceptors=tracing.server_interceptors())
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise SystemExit(f"cannot bind {host}:{port}")
    server.start()
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d", ", ".join(service_names), host, bound)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2).wait()
    log.info("stopped")


def abort(context, code: str, message: str):
    context.abort(getattr(grpc.StatusCode, code), message)
