"""One persistent stream per service for the calls of every round (issue 14: one cheap hop).

A unary call pays a new HTTP/2 stream, its headers and the server's thread hand-off each time; a round
makes one Verify and one Propose. `Lane` keeps one bidirectional stream (TargetService/VerifyStream,
DraftService/ProposeStream) open and sends each call as one message on it; the service answers each
message as its unary method would (services/servicer.py `_stream`). To the Scheduler a lane is the
unary method: same request, same response, same `timeout=`, and a failure raised as the
grpc.aio.AioRpcError the unary call would have raised (gateway/stubs.py).

A stream is reused only after a clean request -> response pair. Any failure, timeout or cancellation
drops it (cancelled, so the service stops reading it) and the next call opens a new one: a late answer
can never be taken for the next call's. A service without the stream methods (UNIMPLEMENTED) is
called unary from then on. Trace context travels in the message (`trace_context`), since a stream's
metadata is sent once.
"""
from __future__ import annotations

import asyncio

import grpc

from infra import tracing


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Lane:
    """`await lane(request, timeout=s)` -> the response, over one reused stream of `open_stream()`."""

    def __init__(self, open_stream, unary, name: str):
        self.open_stream, self.unary, self.name = open_stream, unary, name
        self.call = None               # the open stream, between clean calls
        self.streaming = True
        self.opened = 0                # streams opened (1 while nothing fails)
        self._lock = asyncio.Lock()    # one call at a time on a stream (the Scheduler makes one anyway)

    async def __call__(self, request, *, timeout: float | None = None):
        return await (await self.begin(request, timeout=timeout))

    async def begin(self, request, *, timeout: float | None = None) -> asyncio.Future:
        """Send `request` now; -> a future of its response (the stream is this call's until it is answered).
        The gateway sends a Propose this way before it commits the last round (gateway/proposals.py)."""
        if not self.streaming:
            return asyncio.ensure_future(self.unary(request, timeout=timeout))
        await self._lock.acquire()
        call = None
        try:
            if tracing.enabled():
                request.trace_context.clear()
                request.trace_context.update(tracing.inject_metadata())
            call, self.call = self.call, None
            if call is None or call.done():
                call = self.open_stream()
                self.opened += 1
            await call.write(request)
        except grpc.aio.AioRpcError as e:
            return asyncio.ensure_future(self._failed(call, e, request, timeout))
        except BaseException:                   # cancelled by the caller, or the stream already finished
            self._lock.release()
            if call is not None:
                call.cancel()
            raise
        return asyncio.ensure_future(self._answer(call, request, timeout))

    async def _answer(self, call, request, timeout: float | None):
        """The response to `request`, just written on `call`; frees the stream for the next call."""
        try:
            resp = await asyncio.wait_for(call.read(), timeout)
        except asyncio.TimeoutError:
            call.cancel()
            self._lock.release()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: no answer within {timeout:.3g} s") from None
        except grpc.aio.AioRpcError as e:
            return await self._failed(call, e, request, timeout)
        except BaseException:                   # cancelled by the caller
            call.cancel()
            self._lock.release()
            raise
        self._lock.release()
        if resp is grpc.aio.EOF:                # the service ended the stream without answering
            code, details = await call.code(), await call.details()
            raise rpc_error(code if code != grpc.StatusCode.OK else grpc.StatusCode.UNAVAILABLE,
                            details or f"{self.name}: the stream ended without an answer")
        self.call = call
        return resp

    async def _failed(self, call, e: grpc.aio.AioRpcError, request, timeout: float | None):
        """The stream failed: dropped; raised as the unary call's error, or (UNIMPLEMENTED: an older
        service) the call made unary, as every later one."""
        if call is not None:
            call.cancel()
        self._lock.release()
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise e
        self.streaming = False
        return await self.unary(request, timeout=timeout)

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None


class StreamedTarget:
    """The target as the Scheduler calls it (gateway/stubs.py TargetStub): Verify on a lane, the rest unary."""

    def __init__(self, stub):
        self.stub = stub
        self.Verify = Lane(stub.VerifyStream, stub.Verify, "target VerifyStream")
        self.Prefill, self.RecomputeRows, self.Release = stub.Prefill, stub.RecomputeRows, stub.Release


class StreamedDraft:
    """The draft as the Scheduler calls it (gateway/stubs.py DraftStub): Propose on a lane, Release unary."""

    def __init__(self, stub):
        self.stub = stub
        self.Propose = Lane(stub.ProposeStream, stub.Propose, "draft ProposeStream")
        self.Release = stub.Release
