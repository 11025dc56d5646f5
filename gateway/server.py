"""`tandem gateway`: wiring. Connects to the target (and, when speculating, the draft) and checks they
serve the same model, then runs the scheduler loop, the service watches, the gRPC GenerateService
(gateway/grpc_api.py) and the REST API (gateway/http.py) in one process and event loop until
SIGINT/SIGTERM. The configuration and command line are gateway/config.py."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import _async as health_aio
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from gateway.adaptive import AdaptivePolicy, FixedPolicy
from gateway.auth import ApiKeyInterceptor
from gateway.config import TRANSPORTS, GatewayConfig, parse
from gateway.core import Gateway, Limits, NoTokenizer
from gateway.drain import SETTLE_S, drain
from gateway.grpc_api import GenerateServicer
from gateway.http_server import HttpServer
from gateway.lanes import StreamedDraft, StreamedTarget
from gateway.metrics import GatewayMetrics
from gateway.scheduler import Scheduler
from gateway import watch
from infra import tls as tls_mod, tracing
from infra.grpc_server import bind, channel_options, server_options, stop_signals
from tandem.v1 import common_pb2, draft_pb2_grpc, generate_pb2_grpc, target_pb2_grpc

log = logging.getLogger("tandem.gateway")


async def wait_ready(channel: grpc.aio.Channel, name: str, timeout_s: float) -> bool:
    """Whether the service at `channel` said SERVING within timeout_s (logged every 10 s while waiting)."""
    stub = health_pb2_grpc.HealthStub(channel)
    start = asyncio.get_running_loop().time()
    deadline, said = start + timeout_s, start
    while True:
        if (now := asyncio.get_running_loop().time()) - said >= 10:      # a gateway that waits says so
            said = now
            log.info("waiting for the %s to serve (%.0f s of %.0f; this gateway listens once it does)", name,
                     now - start, timeout_s)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.aio.AioRpcError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.5)


def model_mismatch(target: common_pb2.InfoResponse, draft: common_pb2.InfoResponse) -> list[str]:
    """How draft and target differ in model (identity: services/identity.py) or contract; [] when they agree."""
    return [f"draft and target disagree on {field}: target {getattr(target, field)!r} (--model {target.model}), "
            f"draft {getattr(draft, field)!r} (--model {draft.model})"
            for field in ("model_identity", "contract_version", "vocab_size", "hidden_size")
            if getattr(target, field) != getattr(draft, field)]


def check_same_model(target: common_pb2.InfoResponse, draft: common_pb2.InfoResponse) -> None:
    """Refuse to serve unless draft and target run the same model under the same contract."""
    if wrong := model_mismatch(target, draft):
        raise SystemExit(f"gateway: refusing to serve: {wrong[0]}")


@dataclass
class Services:
    """The target and (when speculating) the draft: stubs, channels and their GetInfo at start (dinfo None:
    the draft did not serve within --draft-wait; the gateway starts without it and its watch brings it in)."""
    target: target_pb2_grpc.TargetServiceStub
    tchan: grpc.aio.Channel
    info: common_pb2.InfoResponse
    draft: draft_pb2_grpc.DraftServiceStub | None = None
    dchan: grpc.aio.Channel | None = None
    dinfo: common_pb2.InfoResponse | None = None

    @property
    def stubs(self) -> dict:
        """name -> stub, for the metrics' GetInfo polls."""
        return {"target": self.target, **({"draft": self.draft} if self.draft is not None else {})}

    def watched(self) -> tuple[tuple, tuple | None]:
        """(channel, stub, info at start) of the target and of the draft, for gateway/watch.py."""
        return (self.tchan, self.target, self.info), (
            (self.dchan, self.draft, self.dinfo) if self.draft is not None else None)


async def connect(cfg: GatewayConfig) -> Services:
    """Wait for the target (and, at once, the draft when K > 0) to serve. No target within --connect-timeout:
    exit 1. No draft within --draft-wait: serve without drafts until it answers (lossless: every token is the
    target's). A draft of another model present at start is refused: a wrong --draft-addr fails loudly."""
    def channel(addr: str) -> grpc.aio.Channel:
        return tls_mod.aio_channel(addr, cfg.tls, options=channel_options() + watch.RECONNECT_OPTIONS,
                                   interceptors=tracing.client_interceptors())
    tchan = channel(cfg.target_addr)
    dchan = channel(cfg.draft_addr) if cfg.num_speculative_tokens > 0 else None
    dready = (asyncio.ensure_future(wait_ready(dchan, f"draft at {cfg.draft_addr}", cfg.draft_wait_s))
              if dchan is not None else None)
    if not await wait_ready(tchan, f"target at {cfg.target_addr}", cfg.connect_timeout_s):
        if dready is not None:
            dready.cancel()
        raise SystemExit(f"target at {cfg.target_addr} did not become SERVING within {cfg.connect_timeout_s:.0f}s "
                         "(--connect-timeout)")
    target = target_pb2_grpc.TargetServiceStub(tchan)
    s = Services(target, tchan, await target.GetInfo(common_pb2.InfoRequest(), timeout=10))
    if dchan is not None:
        s.dchan, s.draft = dchan, draft_pb2_grpc.DraftServiceStub(dchan)
        if await dready:
            s.dinfo = await s.draft.GetInfo(common_pb2.InfoRequest(), timeout=10)
            check_same_model(s.info, s.dinfo)
        else:
            log.warning("the draft at %s did not serve within %.0f s (--draft-wait): serving without drafts until "
                        "it does", cfg.draft_addr, cfg.draft_wait_s)
    return s


def grpc_listener(cfg: GatewayConfig, gw: Gateway) -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
    """The gRPC server (GenerateService behind the API key, health and reflection open), bound -> its port."""
    server = grpc.aio.server(options=server_options(cfg.max_request_bytes),
                             interceptors=[ApiKeyInterceptor(cfg.key)] if cfg.key else None)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(gw), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(["tandem.v1.GenerateService", reflection.SERVICE_NAME,
                                         "grpc.health.v1.Health"], server)
    return server, health, bind(server, cfg.host, cfg.grpc_port, cfg.tls, "--grpc-port", require_client_cert=False)


async def serve(cfg: GatewayConfig) -> None:
    tracing.setup("tandem-gateway", cfg.otlp_endpoint)
    tokenizer = (NoTokenizer(cfg.model_name) if cfg.random_config
                 else Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json")))
    svc = await connect(cfg)
    info = svc.info
    metrics = GatewayMetrics(cfg.model_name)
    target, draft = svc.target, svc.draft           # each round's Verify / Propose on a persistent stream
    if cfg.service_calls != "unary":
        local = cfg.service_calls == "local" and not cfg.tls.cert
        target, draft = (StreamedTarget(target, cfg.busy_poll, local),
                         None if draft is None else StreamedDraft(draft, cfg.busy_poll, local))
    scheduler = Scheduler(target, draft, set(info.eos_token_ids), cfg.max_batch, cfg.rpc_timeout_s,
                          transport=TRANSPORTS[cfg.hidden_transport], observer=metrics,
                          draft_timeout_s=cfg.draft_timeout_s, max_waiting=cfg.max_waiting,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, overlap=cfg.overlap_rounds,
                          propose_ahead=cfg.propose_ahead, join_ahead=cfg.join_ahead,
                          mixed_prefill=cfg.mixed_prefill, late_admission=cfg.late_admission,
                          policy=AdaptivePolicy(cfg.num_speculative_tokens, cfg.adaptive_reprobe_rounds)
                          if cfg.speculation == "adaptive" else FixedPolicy(cfg.num_speculative_tokens))
    scheduler.share_prompts, scheduler.early_propose = info.prefix_caching, cfg.early_propose
    if svc.draft is not None and svc.dinfo is None:
        scheduler.draft_lost(f"the draft at {cfg.draft_addr} has not served since the gateway started")
    metrics.attach(scheduler, svc.stubs)
    gw = Gateway(cfg.model, cfg.model_name, tokenizer, scheduler, Limits(
        info.vocab_size, info.max_model_len, cfg.num_speculative_tokens, cfg.default_max_tokens, cfg.max_logprobs,
        cfg.max_prompt_tokens, cfg.max_output_tokens, cfg.max_request_bytes))
    loop_task = asyncio.ensure_future(scheduler.run())
    watch_tasks = watch.start(scheduler, *svc.watched(), lambda d: model_mismatch(info, d))
    server, health, port = grpc_listener(cfg, gw)
    http = HttpServer(gw, metrics, loop_task, cfg.key, tls=cfg.tls)
    http_port = http.bind(cfg.host, cfg.http_port)
    await server.start()
    http_task = asyncio.ensure_future(http.serve())
    stats_task = (asyncio.ensure_future(metrics.log_periodically(cfg.stats_interval_s))
                  if cfg.stats_interval_s > 0 else None)
    def mirror(up: bool) -> None:             # gRPC health says what /health says of the target (a draft lost: SERVING)
        up = up and scheduler.avail.stopping is None                # (draining: NOT_SERVING for good)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", "tandem.v1.GenerateService"):
            asyncio.ensure_future(health.set(name, status))
    scheduler.avail.on_target.append(mirror)
    mirror(scheduler.avail.target_down is None)
    log.info("gateway serving gRPC on %s:%d and HTTP on %s://%s:%d (model %r, K=%d %s, %s, API key %s)", cfg.host,
             port, "https" if cfg.tls.cert else "http", cfg.host, http_port, cfg.model_name, cfg.num_speculative_tokens,
             cfg.speculation,
             "TLS" if cfg.tls.cert else "plaintext", "required" if cfg.key else "off")
    stop, again = asyncio.Event(), asyncio.Event()
    for sig in stop_signals():
        asyncio.get_running_loop().add_signal_handler(sig, lambda: again.set() if stop.is_set() else stop.set())
    await asyncio.wait([asyncio.ensure_future(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    mirror(False)                             # a load balancer moves on; /health says 503 "shutting down"
    await drain(scheduler, cfg.drain_timeout_s, again)
    await health.enter_graceful_shutdown()
    await http.shutdown()
    await server.stop(grace=2)
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(http_task), timeout=SETTLE_S)   # responses end, not cut
    for t in (loop_task, stats_task, http_task, *watch_tasks):
        if t is not None:
            t.cancel()


def main(argv=None) -> int:
    asyncio.run(serve(parse(argv)))
    return 0
