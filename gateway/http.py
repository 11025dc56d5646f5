"""The gateway's REST API: OpenAI-compatible completions and chat (vLLM's extensions: top_k, seed,
ignore_eos, return_token_ids, /tokenize, /detokenize, /tokenizer_info), /v1/models, /health and
/metrics. FastAPI on uvicorn (gateway/http_server.py), in the gateway's own event loop beside its
gRPC server.

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}; 400 for bad values
(naming the field), 401 without the API key on /v1/*, 404 for an unknown model, 503 when a service
fails, 500 for a bug.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import openai_api as api
from gateway.auth import authorized
from gateway.core import UINT64, GenerationError, Gateway, RequestError
from gateway.http_io import read_limited, until_disconnected
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, hidden_transport
from gateway.responses import Choice, CompletionShaper
from infra import tracing

log = logging.getLogger("tandem.gateway")
READ = ["GET", "HEAD"]                    # HEAD where GET works (RFC 9110; load balancers probe with it)


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(api.error_body(message, status, param, code), status_code=status)


@dataclass(frozen=True)
class ChatFormat:
    """The checkpoint's chat template and special tokens, read once: chat, /tokenize, /tokenizer_info."""
    template: str
    special: dict[str, str]

    @classmethod
    def of(cls, gw: Gateway) -> "ChatFormat":
        special = {k: gw.tokenizer_config.get(k) or "" for k in ("bos_token", "eos_token", "pad_token")}
        eos_ids = sorted(gw.scheduler.eos)
        if not special["eos_token"] and eos_ids:
            special["eos_token"] = gw.tokenizer.id_to_token(eos_ids[0]) or ""
        return cls(api.chat_template(gw.tokenizer_config), special)


def build_app(gw: Gateway, metrics: GatewayMetrics, loop_task: asyncio.Future | None, api_key: str) -> FastAPI:
    """The REST app: the API key and error shapes first, then each group of routes."""
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None, **fastapi_telemetry())
    chat = ChatFormat.of(gw)
    add_guards(app, api_key)
    add_generation_routes(app, gw, chat)
    add_tokenizer_routes(app, gw, chat)
    add_operations_routes(app, gw, metrics, loop_task)
    return app


def add_guards(app: FastAPI, api_key: str) -> None:
    """The API key on /v1/* (401) and the OpenAI-shaped error of every exception a route raises."""
    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if not authorized(request.headers.get("authorization"), api_key):
                return error(401, "missing or wrong API key: send `Authorization: Bearer <key>`")
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, e: RequestError):
        return error(e.status, str(e), e.param, e.code)

    @app.exception_handler(GenerationError)
    async def failed(request: Request, e: GenerationError):
        status = e.http_status or api.GRPC_TO_HTTP.get(e.code.name, 500)
        resp = error(status, str(e), code=api.error_code(e.code, str(e)))
        if status in (429, 503):
            resp.headers["Retry-After"] = "1"
        return resp

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, e: StarletteHTTPException):      # unknown route, wrong method
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        resp = error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        for k, v in (e.headers or {}).items():                               # 405: Allow
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(500, f"internal error: {type(e).__name__}: {e}")


def add_generation_routes(app: FastAPI, gw: Gateway, chat: ChatFormat) -> None:
    """/v1/completions, /v1/chat/completions and /v1/models."""
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(gw, request, api.CompletionRequest)
        check_model(gw, req.model)
        prompts = await asyncio.to_thread(api.completion_prompts, req, gw.encode)      # tokenized off the loop
        if req.max_tokens == 0 and not req.echo:
            raise RequestError("max_tokens", "max_tokens: must be >= 1 (0 only with echo, to score the prompt)")
        common = dict(api.sampling_args(req, req.max_tokens), logprobs=req.logprobs, default_max_tokens=16,
                      prompt_logprobs=req.echo and req.logprobs is not None)      # (OpenAI's default: 16)
        reqs, span = start(gw, expand(prompts, req, common), req, "text_completion", request)
        choices = [Choice(i, r, prompts[i // req.n][1]) for i, r in enumerate(reqs)]
        shaper = CompletionShaper(gw, choices, req, chat=False, num_prompts=len(prompts))
        return await respond(shaper, span, req.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(gw, request, api.ChatRequest)
        check_model(gw, req.model)
        text = await asyncio.to_thread(api.render_chat, chat.template, req.messages, req.add_generation_prompt,
                                       chat.special, req.chat_template_kwargs)        # (Jinja: off the loop)
        ids = await asyncio.to_thread(gw.encode, text, False, "messages")
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, field)
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(field, f"{field}: must be >= 1, got {max_tokens}")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs", "top_logprobs: needs logprobs: true")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= gw.limits.max_logprobs:
            raise RequestError("top_logprobs", f"top_logprobs: must be in [0, {gw.limits.max_logprobs}], "
                                               f"got {req.top_logprobs}")
        common = dict(api.sampling_args(req, max_tokens), tokens_param=field,
                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        reqs, span = start(gw, expand([(ids, text)], req, common), req, "chat", request)
        shaper = CompletionShaper(gw, [Choice(i, r, text) for i, r in enumerate(reqs)], req, chat=True,
                                  num_prompts=1)
        return await respond(shaper, span, req.stream, request)

    def model_card() -> dict:
        return {"id": gw.model_name, "object": "model", "created": int(time.time()), "owned_by": "tandem",
                "root": gw.model_dir, "parent": None, "max_model_len": gw.limits.max_model_len}

    @app.api_route("/v1/models", methods=READ)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=READ)
    async def model(model_id: str):          # the openai client's models.retrieve
        check_model(gw, model_id)
        return model_card()


def add_tokenizer_routes(app: FastAPI, gw: Gateway, chat: ChatFormat) -> None:
    """vLLM's /tokenizer_info, /tokenize and /detokenize."""
    @app.api_route("/tokenizer_info", methods=READ)
    async def tokenizer_info():
        cfg = {k: v for k, v in gw.tokenizer_config.items() if k != "added_tokens_decoder"}
        return {**cfg, **{k: v for k, v in chat.special.items() if v}, "chat_template": chat.template,
                "model_max_length": gw.limits.max_model_len, "vocab_size": gw.limits.vocab_size,
                "tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast")}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(gw, request, api.TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("prompt", "give exactly one of prompt or messages")
        if req.messages is not None:
            text = await asyncio.to_thread(api.render_chat, chat.template, req.messages, req.add_generation_prompt,
                                           chat.special)
            ids = await asyncio.to_thread(gw.encode, text, bool(req.add_special_tokens), "messages", False)
        else:
            ids = await asyncio.to_thread(gw.encode, req.prompt, req.add_special_tokens is not False, "prompt", False)
        return await json_off_loop(lambda: {
            "count": len(ids), "max_model_len": gw.limits.max_model_len, "tokens": ids,
            "token_strs": [gw.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(gw, request, api.DetokenizeRequest)
        bad = [t for t in req.tokens if not 0 <= t < gw.limits.vocab_size]
        if bad:
            raise RequestError("tokens", f"tokens: id {bad[0]} is out of range, vocab_size is {gw.limits.vocab_size}")
        return await json_off_loop(lambda: {"prompt": gw.decode(req.tokens)})


def add_operations_routes(app: FastAPI, gw: Gateway, metrics: GatewayMetrics, loop_task: asyncio.Future | None) -> None:
    """/health (503 with the reason when the gateway cannot serve), /metrics and /ping: open, no API key."""
    @app.api_route("/health", methods=READ)
    async def health():
        reasons = []
        if loop_task is not None and loop_task.done():
            reasons.append("the gateway's scheduler loop has stopped")
        info = await metrics.poll()
        avail = gw.scheduler.avail
        if isinstance(info.get("target"), str):
            reasons.append(f"target unreachable ({info['target']})")
        elif avail.target_down is not None:         # answers GetInfo, not yet back for the gateway
            reasons.append(f"target unavailable ({avail.target_down})")
        if avail.stopping is not None:
            reasons.append(avail.stopping)
        body = {"status": "unavailable" if reasons else "ok", "model": gw.model_name,
                "speculation": avail.speculation(), "hidden_transport": hidden_transport(gw.scheduler, info)}
        if isinstance(info.get("draft"), str):      # the gateway decodes without drafts meanwhile
            body["draft"] = f"unreachable ({info['draft']}); serving without speculation"
        if ("draft" in body or avail.degraded is not None) and not reasons:
            body["status"] = "degraded"             # still 200: it serves, only slower
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.api_route("/metrics", methods=READ)
    async def prometheus():
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/ping", methods=READ)
    async def ping():
        return PlainTextResponse("pong")


# --- what the generation routes share ----------------------------------------------------------------
async def parse_body(gw: Gateway, request: Request, cls):
    """The JSON body parsed into the request model `cls`; a RequestError (400, 413) when it is not one. A chat of
    more messages than the model has positions is refused before validation (each message takes at least one
    token; validating 100k of them held the loop, and every stream, for half a second)."""
    raw = await read_limited(request, gw.limits.max_request_bytes)
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise RequestError(None, f"the request body is not valid JSON: {type(e).__name__}: {e}") from None
    msgs = data.get("messages") if isinstance(data, dict) else None
    if isinstance(msgs, list) and len(msgs) > gw.limits.max_model_len:
        raise RequestError("messages", f"messages: {len(msgs)} messages cannot fit the model's context of "
                                       f"{gw.limits.max_model_len} tokens")
    return api.parse(cls, data)


async def json_off_loop(build) -> Response:
    """A JSON response built and serialized on a worker thread (a /tokenize of a million tokens: its token
    strings and its encoding are Python work that would otherwise stall every stream on the loop)."""
    return Response(await asyncio.to_thread(lambda: json.dumps(build(), ensure_ascii=False, separators=(",", ":"))),
                    media_type="application/json")


def check_model(gw: Gateway, name: str | None) -> None:
    if name is not None and name not in (gw.model_name, gw.model_dir):
        raise RequestError("model", f"The model `{name}` does not exist; this server serves "
                                    f"`{gw.model_name}`.", status=404, code="model_not_found")


def start(gw: Gateway, requests_args: list[dict], req: api._Sampling, operation: str, request: Request):
    """Validate every choice's request before any runs -> (GenRequests, span)."""
    gw.admit(len(requests_args))          # 503 while the target is down, 429 when the queue is full
    span = tracing.start_request_span(
        f"{operation} {gw.model_name}", tracing.incoming(request.headers),
        **{"gen_ai.operation.name": operation, "gen_ai.request.model": gw.model_name,
           "gen_ai.request.max_tokens": requests_args[0]["max_tokens"],
           "gen_ai.request.temperature": requests_args[0]["temperature"],
           "gen_ai.request.top_p": requests_args[0]["top_p"], "gen_ai.request.top_k": requests_args[0]["top_k"],
           "gen_ai.request.seed": req.seed, "gen_ai.request.choice.count": req.n})
    try:
        return [gw.new_request(span=span, **a) for a in requests_args], span
    except BaseException:
        tracing.finish(span)
        raise


def expand(prompts, req, common: dict) -> list[dict]:
    """One new_request argument set per (prompt, choice); choice j of a seeded request uses seed + j."""
    return [dict(common, ids=ids, seed=None if req.seed is None else (req.seed + j) % UINT64)
            for ids, _ in prompts for j in range(req.n)]


async def respond(shaper: CompletionShaper, span, stream: bool, request: Request):
    if stream:                                  # a client gone: the stream's generator closes, cancelling its requests
        return StreamingResponse(shaper.sse(span), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        return await until_disconnected(request, shaper.collect())
    finally:
        shaper.finish_span(span)


def fastapi_telemetry() -> dict:
    """FastAPI versions with built-in OpenTelemetry: keep its HTTP server span (the parent of a
    request's span) on the provider infra.tracing set up; no exporters of its own, no metrics
    (Prometheus has them), no per-dependency spans."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": True, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}
