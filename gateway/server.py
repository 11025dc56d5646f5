"""`tandem gateway`: the public GenerateService (gRPC) in front of the target and draft services."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import _async as health_aio
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from gateway.scheduler import GenRequest, Scheduler
from gateway.text import TextStream
from tandem.grpc_server import channel_options
from tandem.v1 import draft_pb2_grpc, generate_pb2, generate_pb2_grpc, rows_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.gateway")
FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}
TRANSPORTS = {"auto": rows_pb2.TRANSPORT_UNSPECIFIED, "gloo": rows_pb2.TRANSPORT_BRIDGE,
              "nccl": rows_pb2.TRANSPORT_BRIDGE, "inline": rows_pb2.TRANSPORT_INLINE}


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

    def validate(self) -> "GatewayConfig":
        if not 0 <= self.num_speculative_tokens <= 16:
            raise SystemExit(f"--num-speculative-tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if self.hidden_transport not in TRANSPORTS:
            raise SystemExit(f"--hidden-transport must be one of {list(TRANSPORTS)}, got {self.hidden_transport!r}")
        if not (Path(self.model) / "tokenizer.json").exists():
            raise SystemExit(f"--model {self.model}: no tokenizer.json there")
        return self


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, cfg: GatewayConfig, scheduler: Scheduler, tokenizer: Tokenizer, info):
        self.cfg, self.scheduler, self.tokenizer, self.info = cfg, scheduler, tokenizer, info

    def build(self, request: generate_pb2.GenerateRequest) -> GenRequest:
        """Validate a request; raises ValueError naming the field, expected and actual value."""
        which = request.WhichOneof("prompt")
        ids = list(request.token_ids.ids) if which == "token_ids" else (
            self.tokenizer.encode(request.text).ids if which == "text" else [])
        if not ids:
            raise ValueError("prompt: empty (give text or token_ids)")
        bad = [t for t in ids if t >= self.info.vocab_size]
        if bad:
            raise ValueError(f"token_ids: id {bad[0]} is out of range, vocab_size is {self.info.vocab_size}")
        max_tokens = request.max_tokens or self.cfg.default_max_tokens
        limit = self.info.max_model_len
        if len(ids) + max_tokens + self.cfg.num_speculative_tokens + 1 > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                             f"limit of {limit - self.cfg.num_speculative_tokens - 1} tokens")
        if not request.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {request.temperature}")
        if not 0 <= request.top_p <= 1:
            raise ValueError(f"top_p: must be in [0, 1], got {request.top_p}")
        k = self.cfg.num_speculative_tokens
        if request.HasField("num_speculative_tokens"):
            if request.num_speculative_tokens > k:
                raise ValueError(f"num_speculative_tokens: at most {k} on this gateway, got "
                                 f"{request.num_speculative_tokens}")
            k = request.num_speculative_tokens
        sampling = rows_pb2.SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        if request.HasField("seed"):
            sampling.seed = request.seed
        return GenRequest(id=self.scheduler.new_id(), prompt_ids=ids, max_tokens=max_tokens, sampling=sampling,
                          text=TextStream(self.tokenizer, list(request.stop)), ignore_eos=request.ignore_eos, k=k)

    async def _events(self, request, context):
        try:
            r = self.build(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.scheduler.submit(r)
        try:
            while True:
                ev = await r.events.get()
                if ev.error:
                    await context.abort(ev.error[0], ev.error[1])
                yield r, ev
                if ev.finish_reason:
                    return
        finally:
            self.scheduler.cancel(r)

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
        ids, text = [], []
        async for r, ev in self._events(request, context):
            ids += ev.token_ids
            text.append(ev.text)
            if ev.finish_reason:
                resp = generate_pb2.GenerateResponse(request_id=r.id, token_ids=ids, text="".join(text))
                return self._final(r, resp, ev.finish_reason)


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


async def serve(cfg: GatewayConfig) -> None:
    tokenizer = Tokenizer.from_file(str(Path(cfg.model) / "tokenizer.json"))
    tchan = grpc.aio.insecure_channel(cfg.target_addr, options=channel_options())
    await wait_ready(tchan, f"target at {cfg.target_addr}", cfg.connect_timeout_s)
    target = target_pb2_grpc.TargetServiceStub(tchan)
    info = await target.GetInfo(target_pb2.InfoRequest(), timeout=10)
    draft = None
    if cfg.num_speculative_tokens > 0:
        dchan = grpc.aio.insecure_channel(cfg.draft_addr, options=channel_options())
        await wait_ready(dchan, f"draft at {cfg.draft_addr}", cfg.connect_timeout_s)
        draft = draft_pb2_grpc.DraftServiceStub(dchan)
        dinfo = await draft.GetInfo(target_pb2.InfoRequest(), timeout=10)
        for field in ("vocab_size", "hidden_size", "contract_version"):
            if getattr(dinfo, field) != getattr(info, field):
                raise SystemExit(f"draft and target disagree on {field}: draft {getattr(dinfo, field)!r}, "
                                 f"target {getattr(info, field)!r}")
    scheduler = Scheduler(target, draft, set(info.eos_token_ids), cfg.max_batch,
                          transport=TRANSPORTS[cfg.hidden_transport])
    loop_task = asyncio.ensure_future(scheduler.run())
    server = grpc.aio.server(options=channel_options())
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(cfg, scheduler, tokenizer, info), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(["tandem.v1.GenerateService", reflection.SERVICE_NAME,
                                         "grpc.health.v1.Health"], server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    await server.start()
    for name in ("", "tandem.v1.GenerateService"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("gateway serving gRPC on %s:%d (K=%d)", cfg.host, port, cfg.num_speculative_tokens)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(grace=2)
    loop_task.cancel()


def parse(argv) -> GatewayConfig:
    from tandem.cli import default_model
    p = argparse.ArgumentParser(prog="tandem gateway", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (for its tokenizer)")
    p.add_argument("--target-addr", default="127.0.0.1:50052")
    p.add_argument("--draft-addr", default="127.0.0.1:50053")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--hidden-transport", default="auto")
    a = p.parse_args(argv)
    return GatewayConfig(**{**vars(a), "model": str(a.model or default_model())}).validate()


def main(argv=None) -> int:
    asyncio.run(serve(parse(argv)))
    return 0
