"""`tandem gateway`: the public face in front of the target and draft services — the gRPC
GenerateService and the OpenAI-compatible REST API (gateway/http.py), in one process and event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import _async as health_aio
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from gateway.auth import ApiKeyInterceptor
from gateway.core import GenerationError, Gateway, Limits, NoTokenizer, RequestError
from gateway.http_server import HttpServer
from gateway.metrics import GatewayMetrics
from gateway.scheduler import GenRequest, Scheduler
from gateway import watch
from tandem import tls as tls_mod, tracing
from tandem.grpc_server import channel_options
from tandem.v1 import draft_pb2_grpc, generate_pb2, generate_pb2_grpc, rows_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.gateway")
FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}
TRANSPORTS = {"auto": rows_pb2.TRANSPORT_UNSPECIFIED, "gloo": rows_pb2.TRANSPORT_BRIDGE,
              "nccl": rows_pb2.TRANSPORT_BRIDGE, "ipc": rows_pb2.TRANSPORT_BRIDGE,
              "inline": rows_pb2.TRANSPORT_INLINE}


@dataclass(frozen=True)
class GatewayConfig:
    model: str
    target_addr: str = "127.0.0.1:50052"
    draft_addr: str = "127.0.0.1:50053"
    num_speculative_tokens: int = 3
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_batch: int = 64
    default_max_tokens: int = 256
    hidden_transport: str = "auto"
    connect_timeout_s: float = 120.0
    http_port: int = 8000
    served_model_name: str = ""
    api_key: str = ""
    otlp_endpoint: str = ""
    stats_interval_s: float = 10.0
    max_logprobs: int = 20
    max_prompt_tokens: int = 0               # per request; 0: the model's limit
    max_output_tokens: int = 0               # the largest max_tokens; 0: the model's limit
    max_request_bytes: int = 4 << 20         # REST body and gRPC message of the public API
    tls_cert: str = ""                       # TLS on both listeners and to the services (tandem/tls.py)
    tls_key: str = ""
    tls_ca: str = ""
    max_waiting: int = 256                   # requests queued for a Prefill; beyond: 429 / RESOURCE_EXHAUSTED
    rpc_timeout_s: float = 60.0              # a Prefill / Verify / RecomputeRows call (client deadlines bound it)
    draft_timeout_s: float = 10.0            # a Propose; past it the round goes on without drafts
    random_config: str = ""                  # target and draft run a random-weight preset: no tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_name or (f"random-{self.random_config}" if self.random_config
                                          else Path(self.model).name)

    @property
    def tls(self) -> tls_mod.TlsFiles:
        return tls_mod.TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def key(self) -> str:
        """The API key guarding REST /v1/* and gRPC GenerateService ('': open)."""
        return self.api_key or os.environ.get("TANDEM_API_KEY", "")

    def validate(self) -> "GatewayConfig":
        if not 0 <= self.num_speculative_tokens <= 16:
            raise SystemExit(f"--num-speculative-tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if self.hidden_transport not in TRANSPORTS:
            raise SystemExit(f"--hidden-transport must be one of {list(TRANSPORTS)}, got {self.hidden_transport!r}")
        if not self.random_config and not (Path(self.model) / "tokenizer.json").exists():
            raise SystemExit(f"--model {self.model}: no tokenizer.json there")
        if min(self.max_prompt_tokens, self.max_output_tokens) < 0 or self.max_request_bytes < 1024:
            raise SystemExit("--max-prompt-tokens and --max-output-tokens must be >= 0, --max-request-bytes >= 1024")
        self.tls.validate("tandem gateway")
        return self


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, gw: Gateway):
        self.gw = gw

    def build(self, request: generate_pb2.GenerateRequest, span=None) -> GenRequest:
        """Validate a request; raises RequestError naming the field, expected and actual value."""
        which = request.WhichOneof("prompt")
        ids = list(request.token_ids.ids) if which == "token_ids" else (
            self.gw.encode(request.text) if which == "text" else [])
        return self.gw.new_request(
            ids, request.max_tokens or None, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed if request.HasField("seed") else None, stop=list(request.stop),
            ignore_eos=request.ignore_eos, ids_param="token_ids" if which == "token_ids" else "prompt",
            k=request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None, span=span)

    async def _events(self, request, context):
        span = tracing.start_request_span(
            f"generate {self.gw.model_name}", tracing.extract(context.invocation_metadata() or ()),
            **{"gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.gw.model_name,
               "gen_ai.request.max_tokens": request.max_tokens or None,
               "gen_ai.request.temperature": request.temperature, "rpc.system": "grpc"})
        r, finish = None, None
        try:
            try:
                self.gw.admit(1)
                r = self.build(request, span)
            except RequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except GenerationError as e:          # refused: the target is down, or the queue is full
                await context.abort(e.code, str(e))
            left = context.time_remaining()       # the client's deadline bounds the calls made for it
            r.deadline = None if left is None else time.monotonic() + left
            try:
                async for ev in self.gw.events(r):
                    finish = ev.finish_reason
                    yield r, ev
            except GenerationError as e:
                await context.abort(e.code, str(e))
        finally:
            tracing.finish(span, **({} if r is None else {
                "gen_ai.usage.input_tokens": len(r.prompt_ids), "gen_ai.usage.output_tokens": len(r.output_ids),
                "gen_ai.response.id": r.id, "gen_ai.response.finish_reasons": [finish] if finish else None}))

    def _final(self, r, resp: generate_pb2.GenerateResponse, finish: str):
        s = r.stats
        resp.finish_reason = FINISH[finish]
        resp.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids)))
        resp.spec_stats.CopyFrom(generate_pb2.SpecStats(
            num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens, accepted_per_position=s.accepted_per_position))
        return resp

    async def GenerateStream(self, request, context):
        async for r, ev in self._events(request, context):
            resp = generate_pb2.GenerateResponse(request_id=r.id, token_ids=ev.token_ids, text=ev.text)
            yield self._final(r, resp, ev.finish_reason) if ev.finish_reason else resp

    async def Generate(self, request, context):
        ids, text, r, finish = [], [], None, None
        async for r, ev in self._events(request, context):
            ids += ev.token_ids
            text.append(ev.text)
            finish = ev.finish_reason
        resp = generate_pb2.GenerateResponse(request_id=r.id, token_ids=ids, text="".join(text))
        return self._final(r, resp, finish)


async def wait_ready(channel: grpc.aio.Channel, name: str, timeout_s: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit(f"{name} did not become SERVING within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


def check_same_model(target: target_pb2.InfoResponse, draft: target_pb2.InfoResponse) -> None:
    """Refuse to serve unless draft and target run the same model (identity: services/identity.py)
    under the same contract; the error names both sides' values and checkpoints."""
    for field in ("model_identity", "contract_version", "vocab_size", "hidden_size"):
        t, d = getattr(target, field), getattr(draft, field)
        if t != d:
            raise SystemExit(f"gateway: refusing to serve: draft and target disagree on {field}: "
                             f"target {t!r} (--model {target.model}), draft {d!r} (--model {draft.model})")


async def serve(cfg: GatewayConfig) -> None:
    tracing.setup("tandem-gateway", cfg.otlp_endpoint)
    tokenizer = (NoTokenizer(cfg.model_name) if cfg.random_config
                 else Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json")))
    tchan = tls_mod.aio_channel(cfg.target_addr, cfg.tls, options=channel_options() + watch.RECONNECT_OPTIONS,
                                interceptors=tracing.client_interceptors())
    await wait_ready(tchan, f"target at {cfg.target_addr}", cfg.connect_timeout_s)
    target = target_pb2_grpc.TargetServiceStub(tchan)
    info = await target.GetInfo(target_pb2.InfoRequest(), timeout=10)
    services = {"target": target}
    draft = None
    if cfg.num_speculative_tokens > 0:
        dchan = tls_mod.aio_channel(cfg.draft_addr, cfg.tls, options=channel_options() + watch.RECONNECT_OPTIONS,
                                    interceptors=tracing.client_interceptors())
        await wait_ready(dchan, f"draft at {cfg.draft_addr}", cfg.connect_timeout_s)
        draft = services["draft"] = draft_pb2_grpc.DraftServiceStub(dchan)
        dinfo = await draft.GetInfo(target_pb2.InfoRequest(), timeout=10)
        check_same_model(info, dinfo)
    metrics = GatewayMetrics(cfg.model_name)
    scheduler = Scheduler(target, draft, set(info.eos_token_ids), cfg.max_batch, cfg.rpc_timeout_s,
                          transport=TRANSPORTS[cfg.hidden_transport], observer=metrics,
                          draft_timeout_s=cfg.draft_timeout_s, max_waiting=cfg.max_waiting)
    metrics.attach(scheduler, services)
    gw = Gateway(cfg.model, cfg.model_name, tokenizer, scheduler, Limits(
        info.vocab_size, info.max_model_len, cfg.num_speculative_tokens, cfg.default_max_tokens, cfg.max_logprobs,
        cfg.max_prompt_tokens, cfg.max_output_tokens, cfg.max_request_bytes))
    loop_task = asyncio.ensure_future(scheduler.run())
    watch_tasks = watch.start(scheduler, (tchan, target, info), (dchan, draft, dinfo) if draft else None)
    server = grpc.aio.server(options=channel_options(cfg.max_request_bytes),
                             interceptors=[ApiKeyInterceptor(cfg.key)] if cfg.key else None)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(gw), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(["tandem.v1.GenerateService", reflection.SERVICE_NAME,
                                         "grpc.health.v1.Health"], server)
    port = tls_mod.add_port(server, f"{cfg.host}:{cfg.grpc_port}", cfg.tls, require_client_cert=False)
    if not port:
        raise SystemExit(f"gateway: cannot bind the gRPC port {cfg.host}:{cfg.grpc_port}")
    http = HttpServer(gw, metrics, loop_task, cfg.key, tls=cfg.tls)
    http_port = http.bind(cfg.host, cfg.http_port)
    await server.start()
    http_task = asyncio.ensure_future(http.serve())
    stats_task = asyncio.ensure_future(metrics.log_periodically(cfg.stats_interval_s)) if cfg.stats_interval_s > 0 else None
    for name in ("", "tandem.v1.GenerateService"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("gateway serving gRPC on %s:%d and HTTP on %s://%s:%d (model %r, K=%d, %s, API key %s)", cfg.host, port,
             "https" if cfg.tls.cert else "http", cfg.host, http_port, cfg.model_name, cfg.num_speculative_tokens,
             "TLS" if cfg.tls.cert else "plaintext", "required" if cfg.key else "off")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.ensure_future(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    await health.enter_graceful_shutdown()
    await http.shutdown()
    await server.stop(grace=2)
    for t in (loop_task, stats_task, http_task, *watch_tasks):
        if t is not None:
            t.cancel()


def parse(argv) -> GatewayConfig:
    from tandem.cli import default_model
    p = argparse.ArgumentParser(prog="tandem gateway", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (for its tokenizer)")
    p.add_argument("--target-addr", default="127.0.0.1:50052")
    p.add_argument("--draft-addr", default="127.0.0.1:50053")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1", help="address of the gRPC and HTTP listeners")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible REST API, /health, /metrics")
    p.add_argument("--served-model-name", default="", help="the model name of the REST API (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--api-key", default="", help="require `Authorization: Bearer KEY` on /v1/* "
                   "(default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--otlp-endpoint", default="", help="OTLP/gRPC trace export, e.g. http://127.0.0.1:4317 "
                   "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing)")
    p.add_argument("--stats-interval", dest="stats_interval_s", type=float, default=10.0,
                   help="seconds between stats log lines (0: off)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--hidden-transport", default="auto")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued for a Prefill before new ones "
                   "get HTTP 429 / gRPC RESOURCE_EXHAUSTED (0: unbounded)")
    p.add_argument("--rpc-timeout", dest="rpc_timeout_s", type=float, default=60.0,
                   help="seconds a Prefill or Verify call may take (shorter when every request in it has a deadline)")
    p.add_argument("--draft-timeout", dest="draft_timeout_s", type=float, default=10.0,
                   help="seconds a Propose may take before the round goes on without drafts (speculation degraded)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt a request may bring, in "
                   "tokens (400 / INVALID_ARGUMENT beyond; 0: the model's limit)")
    p.add_argument("--max-output-tokens", type=int, default=0, help="largest max_tokens a request may ask for "
                   "(0: the model's limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest REST body (413 beyond) and "
                   "gRPC request message (RESOURCE_EXHAUSTED beyond) of the public API")
    p.add_argument("--random-config", default="", help="target and draft serve a random-weight preset "
                   "(--random-config of `tandem target`): no tokenizer, requests must send token ids")
    tls_mod.add_flags(p)
    a = p.parse_args(argv)
    if a.model and a.random_config:      # as on target and draft: one model, named one way
        p.error(f"--model ({a.model}) and --random-config ({a.random_config}) exclude each other")
    model = a.model or (f"random:{a.random_config}" if a.random_config else default_model())
    return GatewayConfig(**{**vars(a), "model": str(model)}).validate()


def main(argv=None) -> int:
    asyncio.run(serve(parse(argv)))
    return 0
