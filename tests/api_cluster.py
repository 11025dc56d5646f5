"""One local cluster for the user-facing API tests (REST, openai client, lm-eval, grpcurl, metrics,
tracing), shared by those modules through the session-scoped `api_cluster` fixture (conftest.py
exposes it): process starts are the expensive part on a 2-core machine.

make_checkpoint's tiny model (vocab 512), K = 3, gloo bridge, two gateways on free ports:
  gateways[0]: open, a stats log line every second;
  gateways[1]: the same but `--api-key` (REST /v1/* needs `Authorization: Bearer API_KEY`).
Every process exports its spans over OTLP/gRPC to a collector in the test process
(`OtlpCollector`), flushing every 100 ms. This is a helper, not a test file.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from cluster import Cluster, make_checkpoint, serve_module

K = 3
API_KEY = "tandem-test-key"
SEED = 11


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    links: list


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: keeps every span it is sent."""

    def __init__(self):
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(attrs.get("service.name", "?"), s.name, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                                    [link.span_id.hex() for link in s.links]))
        with self.lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, services: set[str], timeout_s: float = 20.0) -> list[Span]:
        """The spans of one trace once every service in `services` has sent some (exporters batch)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if services <= {s.service for s in spans} or time.monotonic() > deadline:
                time.sleep(0.3)              # the batch that closes the trace may still be in flight
                return self.trace(trace_id)
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(grace=1)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ApiCluster:
    cluster: Cluster
    ckpt: Path
    collector: OtlpCollector
    url: str                 # gateway 0's REST base, e.g. http://127.0.0.1:PORT
    keyed_url: str           # gateway 1's (needs API_KEY)
    grpc_addr: str           # gateway 0's gRPC address
    model_name: str

    def __getattr__(self, name):             # dead(), logs(), log_dir ... of the cluster (serve_module)
        return getattr(self.cluster, name)

    def gateway_log(self, i: int = 0) -> str:
        return next(p for p in self.cluster.procs if p.name == self.cluster.gateways[i].name).log.read_text()


@pytest.fixture(scope="session")
def api_cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("api-ckpt") / "tiny", seed=SEED)
    collector = OtlpCollector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with Cluster(ckpt, k=K, log_dir=tmp_path_factory.mktemp("api-logs"),
                     targets=[{"env": env}], drafts=[{"env": env}],
                     gateways=[{"name": "gateway-open", "args": ["--stats-interval", "1"], "env": env},
                               {"name": "gateway-keyed", "args": ["--api-key", API_KEY], "env": env}]) as c:
            gw0, gw1 = c.gateways
            yield from serve_module(ApiCluster(c, ckpt, collector, gw0.http_url, gw1.http_url, gw0.addr, ckpt.name),
                                    request)
    finally:
        collector.stop()
