"""gateway/lanes.py over real gRPC: one stream reused while calls succeed; a failure, timeout or cancellation
drops it and a late answer is never taken for the next call's; a service without the stream method is
called unary. The server side is the services' own stream handler (services/servicer.py `_stream`)."""
import asyncio
import time
from concurrent import futures

import grpc
import pytest

from gateway.lanes import Lane
from services.servicer import STREAM_THREADS, ServicerBase
from tandem.v1 import target_pb2, target_pb2_grpc


class Target(target_pb2_grpc.TargetServiceServicer):
    """Verify answers by the first item's id: "ok:N" -> num_accepted N; "slow:N" -> N after 0.5 s; "bad" -> an
    INVALID_ARGUMENT abort. Counts the calls it ran."""

    def __init__(self):
        self.ran = 0

    def Verify(self, request, context):
        self.ran += 1
        what, _, n = request.items[0].request_id.partition(":")
        if what == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request 'bad': refused")
        if what == "slow":
            time.sleep(0.5)
        return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(num_accepted=int(n))])


class StreamingTarget(Target):
    def lane(self):
        return "tandem.v1.TargetService/Verify", target_pb2.VerifyRequest, self.Verify

    def VerifyStream(self, requests, context):
        return ServicerBase._stream(self, requests, context)


StreamingTarget.VerifyStream.experimental_thread_pool = STREAM_THREADS


def req(rid: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id=rid)])


def run(servicer, body, busy_poll: bool = False):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await body(Lane(stub.VerifyStream, stub.Verify, "target VerifyStream", busy_poll))
    try:
        return asyncio.run(main())
    finally:
        server.stop(0)


def test_one_stream_while_calls_succeed():
    async def body(lane):
        got = [(await lane(req(f"ok:{i}"), timeout=5)).results[0].num_accepted for i in range(20)]
        return got, lane.opened, lane.streaming
    got, opened, streaming = run(StreamingTarget(), body)
    assert got == list(range(20)) and opened == 1 and streaming


@pytest.mark.parametrize("busy_poll", [False, True])
def test_a_failure_is_the_unary_status_and_the_next_call_opens_a_new_stream(busy_poll):
    async def body(lane):
        await lane(req("ok:1"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await lane(req("bad"), timeout=5)
        after = (await lane(req("ok:2"), timeout=5)).results[0].num_accepted
        return e.value, after, lane.opened
    err, after, opened = run(StreamingTarget(), body, busy_poll)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "refused" in err.details()
    assert after == 2 and opened == 2


@pytest.mark.parametrize("busy_poll", [False, True])
def test_a_late_answer_is_never_taken_for_the_next_call(busy_poll):
    async def body(lane):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await lane(req("slow:99"), timeout=0.1)
        nxt = [(await lane(req(f"ok:{i}"), timeout=5)).results[0].num_accepted for i in (7, 8)]
        await asyncio.sleep(0.6)                    # the slow call's answer has come and gone
        last = (await lane(req("ok:9"), timeout=5)).results[0].num_accepted
        return e.value.code(), nxt, last, lane.opened
    code, nxt, last, opened = run(StreamingTarget(), body, busy_poll)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert nxt == [7, 8] and last == 9 and opened == 2


@pytest.mark.parametrize("busy_poll", [False, True])
def test_cancelled_caller_drops_the_stream(busy_poll):
    async def body(lane):
        task = asyncio.ensure_future(lane(req("slow:5"), timeout=5))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return (await lane(req("ok:3"), timeout=5)).results[0].num_accepted, lane.opened
    assert run(StreamingTarget(), body, busy_poll) == (3, 2)


def test_a_service_without_the_stream_is_called_unary():
    target = Target()

    async def body(lane):
        got = [(await lane(req(f"ok:{i}"), timeout=5)).results[0].num_accepted for i in range(3)]
        return got, lane.streaming
    got, streaming = run(target, body)
    assert got == [0, 1, 2] and not streaming and target.ran == 3


@pytest.mark.parametrize("busy_poll", [False, True])
def test_the_hops_of_a_streamed_call_come_from_the_services_stamps(busy_poll):
    """The handler stamps when it got the message and built its answer (one host, one CLOCK_MONOTONIC): the two
    one-way hops exclude the handler's 0.5 s; unary answers carry no stamps, so no hops."""
    async def body(lane):
        t0 = time.perf_counter()
        resp = await lane(req("slow:1"), timeout=5)
        wall = time.perf_counter() - t0
        return resp.timing, lane.legs(resp.timing), wall
    timing, legs, wall = run(StreamingTarget(), body, busy_poll)
    assert timing.answered_at - timing.received_at >= 0.5
    assert legs is not None and min(legs) >= 0 and wall >= 0.5 + sum(legs)   # (no bound on a busy CI's hops)

    async def unary(lane):
        resp = await lane(req("ok:1"), timeout=5)
        return lane.legs(resp.timing)
    assert run(Target(), unary) is None


class LateWrite:
    """A stream whose first write waits until the service has ended it (the race a write can lose)."""

    def __init__(self, call):
        self.call = call

    def __getattr__(self, name):
        return getattr(self.call, name)

    async def write(self, request):
        await self.call.code()
        await self.call.write(request)


def test_a_write_that_loses_the_race_with_the_streams_end_goes_unary():
    """A service without the stream method ends the stream UNIMPLEMENTED; a write after that end (the call
    already over, or gRPC core's INTERNAL) never left, so the call goes unary and is answered, not an error of
    the round. A service that refuses the call refuses it unary too, with its own status."""
    async def body(lane):
        lane.open_stream = (lambda opened: lambda: LateWrite(opened()))(lane.open_stream)
        ok = await lane(req("ok:2"), timeout=5)
        try:
            await lane(req("bad"), timeout=5)
        except grpc.aio.AioRpcError as e:
            return ok, e.code()
    ok, refused = run(Target(), body)
    assert ok.results[0].num_accepted == 2 and refused == grpc.StatusCode.INVALID_ARGUMENT
