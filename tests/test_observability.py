"""Metrics, the stats log line, tracing and the gRPC API through `grpcurl`, against the shared local
cluster (api_cluster.py), whose three processes export spans over OTLP to a collector in this
test process."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest

from api_cluster import K
from infra import tracing
from tandem.v1 import generate_pb2 as gen

pytestmark = pytest.mark.slow
SPEC = ("tandem:spec_decode_num_drafts_total", "tandem:spec_decode_num_draft_tokens_total",
        "tandem:spec_decode_num_accepted_tokens_total")


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (model_name label dropped)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?model_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            out[key] = float(value)
    return out


def test_metrics_move(api_cluster):
    before = scrape(api_cluster.url)
    with httpx.Client(base_url=api_cluster.url, timeout=120) as c:
        for i in range(3):
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7 + i], "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200
    after = scrape(api_cluster.url)
    for name in SPEC:
        assert after[name] > before.get(name, 0), name
    drafts = after[SPEC[0]] - before.get(SPEC[0], 0)
    assert after[SPEC[1]] - before.get(SPEC[1], 0) == K * drafts          # every round drafted K tokens
    per_pos = [after.get(f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
               for i in range(K)]
    assert sum(per_pos) == after[SPEC[2]] and per_pos == sorted(per_pos, reverse=True)
    for h in ("tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count"):
        assert after[h] - before.get(h, 0) == 3, h
    assert after["tandem:inter_token_latency_seconds_count"] - before.get("tandem:inter_token_latency_seconds_count", 0) == 3 * 11
    for phase in ("prefill", "propose", "transfer", "verify"):
        assert after[f'tandem:round_phase_seconds_count{{phase="{phase}"}}'] > before.get(
            f'tandem:round_phase_seconds_count{{phase="{phase}"}}', 0), phase
    per = {ph: [after[f'tandem:round_phase_seconds_{x}{{phase="{ph}"}}'] - before.get(
        f'tandem:round_phase_seconds_{x}{{phase="{ph}"}}', 0) for x in ("sum", "count")]
        for ph in ("round", "rpc_request", "rpc_response", "rpc_service")}
    for ph in ("rpc_request", "rpc_response", "rpc_service"):   # from the services' stamps (one host)
        assert per[ph][1] > 0 and 0 <= per[ph][0] / per[ph][1] < per["round"][0] / per["round"][1], (ph, per)
    for service in ("target", "draft"):
        assert after[f'tandem:kv_cache_blocks_free{{service="{service}"}}'] > 0
        assert f'tandem:kv_cache_blocks_used{{service="{service}"}}' in after
    assert after["tandem:num_requests_running"] == 0 and after["tandem:num_requests_waiting"] == 0
    assert after['tandem:request_success_total{finished_reason="length"}'] >= 3


def test_stats_log_line(api_cluster):
    """gateway-open logs every second while it works: mean acceptance length and per position."""
    httpx.post(api_cluster.url + "/v1/completions", timeout=120, json={"prompt": [9, 8, 7], "max_tokens": 12,
                                                                       "ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:                       # the line comes at the next tick of the gateway's 1 s timer
        lines = [ln for ln in api_cluster.gateway_log(0).splitlines() if "spec decode: mean acceptance length" in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lines, api_cluster.gateway_log(0)[-2000:]
    m = re.search(r"mean acceptance length ([\d.]+).*per-position acceptance \[([^\]]*)\]", lines[-1])
    assert 1.0 <= float(m.group(1)) <= K + 1 and len(m.group(2).split(",")) == K


def test_one_trace_across_services(api_cluster):
    """A request sent with a W3C traceparent: gateway, draft and target spans all join its trace."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(api_cluster.url + "/v1/completions", timeout=120,
                   headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                   json={"prompt": "def main():", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    spans = api_cluster.collector.wait_for(trace_id, {"tandem-gateway", "tandem-draft", "tandem-target"})
    by_service = {s.service for s in spans}
    assert by_service == {"tandem-gateway", "tandem-draft", "tandem-target"}, [(s.service, s.name) for s in spans]
    names = {(s.service, s.name) for s in spans}
    for want in [("tandem-gateway", "prefill"), ("tandem-gateway", "propose"), ("tandem-gateway", "verify"),
                 ("tandem-target", "tandem.v1.TargetService/Prefill"), ("tandem-target", "target.verify"),
                 ("tandem-draft", "tandem.v1.DraftService/Propose"), ("tandem-draft", "draft.transfer"),
                 ("tandem-draft", "draft.propose")]:
        assert want in names, (want, sorted(names))
    root = next(s for s in spans if s.name.startswith("text_completion "))
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == api_cluster.model_name
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    ids = {s.span_id: s for s in spans}

    def ancestors(s) -> list[str]:
        out = [s.parent_id]
        while out[-1] in ids:
            out.append(ids[out[-1]].parent_id)
        return out
    for s in spans:            # one tree under the caller's span; the services' spans under the request's
        assert ancestors(s)[-1] == "00f067aa0ba902b7", (s.service, s.name)
        if s.service != "tandem-gateway":
            assert root.span_id in ancestors(s), (s.service, s.name)


def test_interceptors_with_in_memory_exporter():
    """In process: a phase span's context crosses a gRPC call into the server's spans (SDK exporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, set_global=False)

    def ping(request, context):
        with tracing.span("target.verify"):
            return request
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=tracing.server_interceptors())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
        "Ping": grpc.unary_unary_rpc_method_handler(ping)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def call():
        roots = [tracing.start_request_span(f"request {i}") for i in range(2)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=tracing.client_interceptors()) as ch:
            with tracing.phase("verify", roots):
                assert await ch.unary_unary("/test.Echo/Ping")(b"x", timeout=10) == b"x"
        for r in roots:
            tracing.finish(r)
    try:
        asyncio.run(call())
    finally:
        server.stop(0)
        tracing.install(None)
    got = exporter.get_finished_spans()
    spans = {s.name: s for s in got}
    assert sorted(s.name for s in got) == sorted(["request 0", "request 1", "verify", "verify", "test.Echo/Ping",
                                                  "target.verify"])
    server_span, inner = spans["test.Echo/Ping"], spans["target.verify"]
    phase0 = next(s for s in got if s.name == "verify" and s.links)
    root0 = next(s for s in got if s.name == "request 0")
    assert server_span.parent.span_id == phase0.context.span_id and inner.parent.span_id == server_span.context.span_id
    assert len({server_span.context.trace_id, inner.context.trace_id, phase0.context.trace_id,
                root0.context.trace_id}) == 1
    other = next(s for s in got if s.name == "verify" and not s.links)
    assert phase0.links[0].context.span_id == other.context.span_id


def grpcurl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    exe = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run([exe, "-plaintext", *args], capture_output=True, text=True, timeout=timeout)


def test_grpcurl(api_cluster):
    addr = api_cluster.grpc_addr
    out = grpcurl(addr, "list")
    assert out.returncode == 0, out.stderr
    assert {"tandem.v1.GenerateService", "grpc.health.v1.Health"} <= set(out.stdout.split())
    out = grpcurl(addr, "describe", "tandem.v1.GenerateService")
    assert out.returncode == 0 and "GenerateStream" in out.stdout, out.stderr
    out = grpcurl("-d", '{"service": "tandem.v1.GenerateService"}', addr, "grpc.health.v1.Health/Check")
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "SERVING", out.stderr
    body = {"text": "def main():", "max_tokens": 10, "ignore_eos": True}
    out = grpcurl("-d", json.dumps(body), addr, "tandem.v1.GenerateService/GenerateStream")
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(m) for m in re.split(r"(?<=\})\n(?=\{)", out.stdout.strip())]
    ids = [int(t) for m in msgs for t in m.get("token_ids", [])]         # grpcurl keeps the proto's names
    assert msgs[-1]["finish_reason"] == "FINISH_REASON_LENGTH" and msgs[-1]["usage"]["completion_tokens"] == 10
    ref = api_cluster.cluster.gateways[0].stub.Generate(gen.GenerateRequest(**body), timeout=120)
    assert ids == list(ref.token_ids)
