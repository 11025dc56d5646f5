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
import time

import grpc

from infra import tracing
from tandem.v1 import draft_pb2, target_pb2


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def carry_trace(request) -> None:
    """Trace context travels in the message (a stream's or a socket's metadata is sent once)."""
    if tracing.enabled():
        request.trace_context.clear()
        request.trace_context.update(tracing.inject_metadata())


class Lane:
    """`await lane(request, timeout=s)` -> the response, over one reused stream of `open_stream()`."""

    def __init__(self, open_stream, unary, name: str, busy_poll: bool = False):
        self.open_stream, self.unary, self.name = open_stream, unary, name
        self.call = None               # the open stream, between clean calls
        self.streaming = True
        self.opened = 0                # streams opened (1 while nothing fails)
        self.written_at = self.read_at = 0.0   # the last call's message written, its answer read (perf_counter)
        self.busy_poll = busy_poll
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
            carry_trace(request)
            call, self.call = self.call, None
            if call is None or call.done():
                call = self.open_stream()
                self.opened += 1
            self.written_at = time.perf_counter()    # before the write: its await may return after the service has it
            await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:   # (the latter: the stream ended first)
            return asyncio.ensure_future(self._failed(call, e, request, timeout, delivered=False))
        except BaseException:                   # cancelled by the caller
            self._lock.release()
            if call is not None:
                call.cancel()
            raise
        return asyncio.ensure_future(self._answer(call, request, timeout))

    async def _answer(self, call, request, timeout: float | None):
        """The response to `request`, just written on `call`; frees the stream for the next call."""
        try:
            resp = await self._read(call, timeout)
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
        self.read_at = time.perf_counter()
        self._lock.release()
        if resp is grpc.aio.EOF:                # the service ended the stream without answering
            code, details = await call.code(), await call.details()
            raise rpc_error(code if code != grpc.StatusCode.OK else grpc.StatusCode.UNAVAILABLE,
                            details or f"{self.name}: the stream ended without an answer")
        self.call = call
        return resp

    async def _read(self, call, timeout: float | None):
        """call.read() within `timeout` (asyncio.TimeoutError past it). busy_poll: the loop keeps turning until
        the answer is in, never sleeping in its poll: a CPU left idle for the call's few milliseconds takes
        0.2-0.4 ms to wake on the VMs measured (BENCHMARKS.md "The hops of a call"), once per hop it sleeps."""
        if not self.busy_poll:
            return await asyncio.wait_for(call.read(), timeout)
        read = asyncio.ensure_future(call.read())
        end = time.perf_counter() + (timeout if timeout is not None else float("inf"))
        try:
            while not read.done():
                if time.perf_counter() > end:
                    raise asyncio.TimeoutError
                await asyncio.sleep(0)
        except BaseException:
            read.cancel()
            raise
        return read.result()

    async def _failed(self, call, e: Exception, request, timeout: float | None, delivered: bool = True):
        """The stream failed: dropped; raised as the unary call's error, or (UNIMPLEMENTED: an older
        service) the call made unary, as every later one. A write that failed in gRPC's core (INTERNAL) or
        found the stream already over lost the race with the stream's end (an older service's UNIMPLEMENTED,
        a service gone): its message never left, so this call goes unary, which answers with the service's
        own status (the next call tries the stream again)."""
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
        if call is not None:
            call.cancel()
        self._lock.release()
        if code == grpc.StatusCode.UNIMPLEMENTED:
            self.streaming = False
        elif delivered or code not in (None, grpc.StatusCode.INTERNAL):
            raise e
        return await self.unary(request, timeout=timeout)

    def legs(self, timing) -> tuple[float, float] | None:
        """The last call's one-way hops (seconds): message written -> the service's handler got it, response
        built -> read here, from the service's stamps (CallTiming received_at / answered_at; a service on
        this host shares the clock). None when unstamped (unary, in process) or out of the call's span (a
        service on another host's clock)."""
        if not (timing.received_at and timing.answered_at):
            return None
        out = timing.received_at - self.written_at, self.read_at - timing.answered_at
        span = self.read_at - self.written_at
        return out if min(out) >= 0 and sum(out) <= span else None

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None


def lane(stub, stream, unary, name: str, busy_poll: bool, local: bool, method: str, response_cls) -> Lane:
    """A round call's lane: on the service's local lane where it offers one this gateway reaches (local), else on
    its gRPC stream (gateway/local_lane.py)."""
    if not local:
        return Lane(stream, unary, name, busy_poll)
    from gateway.local_lane import LocalLane
    return LocalLane(stream, unary, name, busy_poll, stub.GetInfo, method, response_cls)


class StreamedTarget:
    """The target as the Scheduler calls it (gateway/stubs.py TargetStub): Verify on a lane, the rest unary."""

    def __init__(self, stub, busy_poll: bool = False, local: bool = False):
        self.stub = stub
        self.Verify = lane(stub, stub.VerifyStream, stub.Verify, "target VerifyStream", busy_poll, local,
                           "tandem.v1.TargetService/Verify", target_pb2.VerifyResponse)
        self.Prefill, self.RecomputeRows, self.Release = stub.Prefill, stub.RecomputeRows, stub.Release


class StreamedDraft:
    """The draft as the Scheduler calls it (gateway/stubs.py DraftStub): Propose on a lane, Release unary."""

    def __init__(self, stub, busy_poll: bool = False, local: bool = False):
        self.stub = stub
        self.Propose = lane(stub, stub.ProposeStream, stub.Propose, "draft ProposeStream", busy_poll, local,
                            "tandem.v1.DraftService/Propose", draft_pb2.ProposeResponse)
        self.Release = stub.Release
