"""`python -m tandem.healthcheck HOST:PORT | URL [--tls-cert PEM --tls-key PEM] [--tls-ca PEM]`: exit 0
when the gRPC server at HOST:PORT is SERVING, or when GET URL (e.g. the gateway's
http://127.0.0.1:8000/health) answers 200. With TLS flags the probe speaks TLS (a client certificate
for services that require one; the CA verifies the server, for https:// URLs too)."""
import argparse
import ssl
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra import tls as tls_mod


def http_ok(url: str, tls: tls_mod.TlsFiles) -> bool:
    ctx = ssl.create_default_context(cafile=tls.ca or None) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=3, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def grpc_ok(addr: str, tls: tls_mod.TlsFiles) -> bool:
    stub = health_pb2_grpc.HealthStub(tls_mod.channel(addr, tls))
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m tandem.healthcheck")
    p.add_argument("target")
    tls_mod.add_flags(p)
    a = p.parse_args()
    tls = tls_mod.TlsFiles(a.tls_cert, a.tls_key, a.tls_ca)
    ok = http_ok(a.target, tls) if a.target.startswith(("http://", "https://")) else grpc_ok(a.target, tls)
    sys.exit(0 if ok else 1)
