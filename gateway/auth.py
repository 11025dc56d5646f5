"""The gateway's API key on gRPC: GenerateService calls must carry `authorization: Bearer KEY` in their
metadata (the header REST's /v1/* checks), else UNAUTHENTICATED before the request is read.
Health and reflection stay open (orchestrators probe them), as REST's /health and /metrics do."""
from __future__ import annotations

import secrets

import grpc

GUARDED_PREFIX = "/tandem.v1.GenerateService/"
MESSAGE = "missing or wrong API key: send metadata `authorization: Bearer <key>`"


def authorized(header: str | bytes | None, api_key: str) -> bool:
    """An Authorization value `Bearer api_key` (the scheme in any case, RFC 9110; the key compared in constant
    time)."""
    given = header.encode() if isinstance(header, str) else (header or b"")
    scheme, _, key = given.strip().partition(b" ")
    return secrets.compare_digest(key.strip() if scheme.lower() == b"bearer" else b"", api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self.api_key = api_key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(GUARDED_PREFIX):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if authorized(header, self.api_key):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or server-streaming) that answers UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
