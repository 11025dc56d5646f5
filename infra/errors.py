"""The error a service answers a request with: what the engines raise and the gRPC servers turn into a status."""
from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; `code` is the grpc.StatusCode name it answers with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# How a service's RESOURCE_EXHAUSTED for a full KV cache begins: not the caller's fault nor a broken service, but
# load; the gateway preempts a request (recomputed later) or holds new ones back (gateway/scheduler.py).
KV_CACHE_FULL = "KV cache pool exhausted"
