"""OpenTelemetry tracing shared by gateway, draft and target (no torch here: the gateway uses it).

`setup(service, endpoint)` installs an SDK TracerProvider with an OTLP/gRPC exporter when
`--otlp-endpoint` or OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set; otherwise no
provider and no exporter, and every helper here returns at once. Tests may `install()` their own
provider (e.g. with the SDK's InMemorySpanExporter).

W3C trace context travels in gRPC metadata (`traceparent`, `tracestate`): the gateway's channels
inject the current context (`client_interceptors()`), the target's and draft's servers extract it
and run each call inside a SERVER span (`server_interceptors()`), so one request's gateway, draft
and target spans share one trace id. A round serves a batch: `phase()` opens one span per request
of the batch; the RPC carries the first request's span, which links to the others'.
"""
from __future__ import annotations

import atexit
import logging
import os
from contextlib import contextmanager

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger("tandem.tracing")
_enabled = False
_provider = None
SKIP_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")   # polled often; not worth a span


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    return (_provider or trace.get_tracer_provider()).get_tracer("tandem")


def install(provider, set_global: bool = True) -> None:
    """Use `provider` (an SDK TracerProvider) for Tandem's spans (and, by default, as the global one).
    install(None) turns tracing off again (tests)."""
    global _enabled, _provider
    if provider is not None and set_global:
        trace.set_tracer_provider(provider)
    _enabled, _provider = provider is not None, provider


def otlp_endpoint(flag: str | None = None) -> str:
    return (flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "")


def setup(service: str, endpoint: str | None = None) -> bool:
    """OTLP export of this process's spans when an endpoint is configured; -> whether it is."""
    endpoint = otlp_endpoint(endpoint)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=endpoint, insecure=not endpoint.startswith("https://"))))
    install(provider)
    atexit.register(provider.shutdown)          # flush what is queued when the process ends
    log.info("tracing: OTLP export of %s spans to %s", service, endpoint)
    return True


def extract(metadata) -> otel_context.Context:
    """Trace context from gRPC invocation metadata or HTTP headers (pairs or a mapping)."""
    items = metadata.items() if hasattr(metadata, "items") else metadata
    return propagate.extract({k.lower(): v for k, v in items or ()})


def incoming(carrier) -> otel_context.Context | None:
    """The parent of a request's root span: the current span when a framework already opened one
    (FastAPI's HTTP server span), else the caller's context from `carrier` (headers, metadata)."""
    if trace.get_current_span().get_span_context().is_valid:
        return None
    return extract(carrier)


def inject_metadata() -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


# --- gRPC interceptors -----------------------------------------------------------------------------
class _AioClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        if _enabled and trace.get_current_span().get_span_context().is_valid:
            md = list(details.metadata or ()) + inject_metadata()
            details = grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*md),
                                                 details.credentials, details.wait_for_ready)
        return await continuation(details, request)


def client_interceptors() -> list:
    return [_AioClientInterceptor()]


class _ServerInterceptor(grpc.ServerInterceptor):
    """Sync servers (target, draft): each unary call runs in a SERVER span, child of the caller's."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if not _enabled or handler is None or handler.unary_unary is None or method.startswith(SKIP_METHODS):
            return handler
        inner, metadata = handler.unary_unary, details.invocation_metadata

        def traced(request, context):
            with server_span(method.lstrip("/"), metadata):
                return inner(request, context)
        return grpc.unary_unary_rpc_method_handler(traced, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def server_interceptors() -> list:
    return [_ServerInterceptor()]


@contextmanager
def server_span(method: str, carrier):
    """A SERVER span named after the unary method ("tandem.v1.TargetService/Verify"), child of the trace
    context in `carrier`: a unary call's metadata (the interceptor) or a stream message's trace_context."""
    if not _enabled:
        yield None
        return
    service, _, name = method.rpartition("/")
    with tracer().start_as_current_span(method, context=extract(carrier), kind=trace.SpanKind.SERVER,
                                        attributes={"rpc.system": "grpc", "rpc.service": service,
                                                    "rpc.method": name}) as s:
        yield s


# --- spans -----------------------------------------------------------------------------------------
@contextmanager
def span(name: str, **attributes):
    """A child of the current span (no-op without tracing)."""
    if not _enabled:
        yield None
        return
    with tracer().start_as_current_span(name, attributes=attributes) as s:
        yield s


def start_request_span(name: str, parent: otel_context.Context | None = None, **attributes):
    """The root span of one client request at the gateway (None without tracing); end it with finish()."""
    if not _enabled:
        return None
    return tracer().start_span(name, context=parent, kind=trace.SpanKind.SERVER,
                               attributes={k: v for k, v in attributes.items() if v is not None})


def finish(s, **attributes) -> None:
    if s is not None:
        s.set_attributes({k: v for k, v in attributes.items() if v is not None})
        s.end()


@contextmanager
def phase(name: str, parents: list, **attributes):
    """One span `name` per request (its root span in `parents`) for a round phase of a batch. The
    first is current inside the block (an RPC made there carries its context) and links to the
    others, so each request's trace has the phase and the services' spans are reachable from all."""
    parents = [p for p in parents if p is not None]
    if not _enabled or not parents:
        yield []
        return
    t = tracer()
    rest = [t.start_span(name, context=trace.set_span_in_context(p), attributes=attributes) for p in parents[1:]]
    first = t.start_span(name, context=trace.set_span_in_context(parents[0]), attributes=attributes,
                         links=[trace.Link(s.get_span_context()) for s in rest])
    spans = [first] + rest
    try:
        with trace.use_span(first, end_on_exit=False):
            yield spans
    finally:
        for s in spans:
            s.end()
