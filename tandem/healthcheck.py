"""`python -m tandem.healthcheck HOST:PORT | URL`: exit 0 when the gRPC server at HOST:PORT is
SERVING, or when GET URL (e.g. the gateway's http://127.0.0.1:8000/health) answers 200."""
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def grpc_ok(addr: str) -> bool:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


if __name__ == "__main__":
    target = sys.argv[1]
    sys.exit(0 if (http_ok(target) if target.startswith(("http://", "https://")) else grpc_ok(target)) else 1)
