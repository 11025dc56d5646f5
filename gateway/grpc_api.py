"""The gRPC face of the gateway: tandem.v1.GenerateService (Generate, GenerateStream) over the shared
request life in gateway/core.py; errors are the gRPC status of the request's failure."""
from __future__ import annotations

import asyncio
import time

import grpc

from gateway.core import GenerationError, Gateway, RequestError
from gateway.request import GenRequest
from infra import tracing
from tandem.v1 import generate_pb2, generate_pb2_grpc

FINISH = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Generate and GenerateStream: one request each, validated, admitted and run like a REST one."""

    def __init__(self, gw: Gateway):
        self.gw = gw

    async def build(self, request: generate_pb2.GenerateRequest, span=None) -> GenRequest:
        """Validate a request (its text tokenized off the event loop); raises RequestError naming the field,
        expected and actual value."""
        which = request.WhichOneof("prompt")
        ids = list(request.token_ids.ids) if which == "token_ids" else (
            await asyncio.to_thread(self.gw.encode, request.text, True, "text") if which == "text" else [])
        return self.gw.new_request(
            ids, request.max_tokens or None, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed if request.HasField("seed") else None, stop=list(request.stop),
            ignore_eos=request.ignore_eos, ids_param=which or "prompt",
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
                r = await self.build(request, span)
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
