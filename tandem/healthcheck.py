"""`python -m tandem.healthcheck HOST:PORT`: exit 0 when the gRPC server there is SERVING."""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if __name__ == "__main__":
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1]))
    try:
        ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        ok = False
    sys.exit(0 if ok else 1)
