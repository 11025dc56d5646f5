"""A REST request's body read within its limit, and a whole (not streamed) response that a client gone first
cancels (gateway/http.py)."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.core import RequestError


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused with 413 naming the limit once it exceeds `limit` bytes (declared or streamed):
    never buffered past the limit."""
    def too_large(n: str):
        return RequestError(None, f"request body of {n} bytes exceeds this gateway's limit of {limit} bytes "
                                  "(--max-request-bytes)", status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnected(request: Request, work) -> Response:
    """The whole response `work` makes; a client that disconnects first cancels it, and so its requests (as a
    stream's), instead of their running to max_tokens for nobody -> 499 (nginx's "client closed request"), which
    nobody reads. The body was read: the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():                 # (also when this handler itself is cancelled)
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    return JSONResponse(task.result())
