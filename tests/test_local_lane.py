"""The local lane (services/lane.py, gateway/local_lane.py) between real processes: the service side runs in a
child process (its own lane server and gRPC server, as `tandem target` starts them), the gateway side is the
gateway's LocalLane over a real grpc.aio channel. Calls reuse one connection; a failure keeps the status the
gRPC stream would have; a timeout or cancellation drops the connection and no late answer is taken for the
next call; a service gone is UNAVAILABLE; a lane this process cannot reach (or none) means the gRPC stream."""
import asyncio
import multiprocessing as mp
import socket
import time

import grpc
import pytest

from gateway.lanes import StreamedTarget
from infra import lane_wire as wire
from services.lane import LaneContext, LaneServer
from tandem.v1 import target_pb2

from test_lanes import StreamingTarget, req


class Served(StreamingTarget):
    """test_lanes' target ("ok:N", "slow:N", "bad"; "boom" raises) whose GetInfo names its lane (or `lane_name`)."""

    lane_name = None

    def Verify(self, request, context):
        if request.items[0].request_id == "boom":
            raise RuntimeError("the kernel fell over")
        return super().Verify(request, context)

    def GetInfo(self, request, context):
        from tandem.v1 import common_pb2
        return common_pb2.InfoResponse(local_lane=self.lane_name or self.lane_server.name)


def serve(port_q, lane_name, spin_s):
    """The child: a gRPC server with VerifyStream and GetInfo, and the lane server, until killed."""
    from concurrent import futures
    from services.servicer import ServicerBase
    from tandem.v1 import target_pb2_grpc
    t = Served()
    t.lane_name = lane_name
    ServicerBase.open_lane(t, spin_s, 1 << 20)          # as a service opens it (services/launch.py)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(t, server)
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def run(body, busy_poll=False, lane_name=None, spin_s=0.0):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=serve, args=(q, lane_name, spin_s), daemon=True)
    child.start()
    try:
        port = q.get(timeout=60)

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                from tandem.v1 import target_pb2_grpc
                t = StreamedTarget(target_pb2_grpc.TargetServiceStub(ch), busy_poll, local=True)
                return await body(t.Verify, child)
        return asyncio.run(main())
    finally:
        child.kill()
        child.join()


async def n_of(lane, rid):
    return (await lane(req(rid), timeout=5)).results[0].num_accepted


@pytest.mark.parametrize("busy_poll,spin_s", [(False, 0.0), (True, 0.05)])
def test_calls_go_on_one_local_connection(busy_poll, spin_s):
    async def body(lane, _):
        got = [await n_of(lane, f"ok:{i}") for i in range(20)]
        resp = await lane(req("slow:1"), timeout=5)
        return got, lane.local_calls, lane.opened, lane.legs(resp.timing)
    got, local, opened, legs = run(body, busy_poll, spin_s=spin_s)
    assert got == list(range(20)) and local == 21 and opened == 0      # no gRPC stream was opened
    assert legs is not None and min(legs) >= 0


@pytest.mark.parametrize("busy_poll", [False, True])
def test_a_failure_keeps_its_status_and_the_connection(busy_poll):
    async def body(lane, _):
        errs = []
        for rid in ("bad", "boom"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await n_of(lane, rid)
            errs.append(e.value)
        sock = lane.sock
        return errs, await n_of(lane, "ok:2"), sock is lane.sock
    (bad, boom), after, same = run(body, busy_poll)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "refused" in bad.details()
    assert boom.code() == grpc.StatusCode.INTERNAL
    assert "tandem.v1.TargetService/Verify" in boom.details() and "the kernel fell over" in boom.details()
    assert after == 2 and same


@pytest.mark.parametrize("busy_poll", [False, True])
def test_a_late_answer_is_never_taken_for_the_next_call(busy_poll):
    async def body(lane, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await lane(req("slow:99"), timeout=0.1)
        nxt = [await n_of(lane, f"ok:{i}") for i in (7, 8)]
        await asyncio.sleep(0.6)                    # the slow call's answer has come and gone
        return e.value.code(), nxt, await n_of(lane, "ok:9"), lane.local_calls
    code, nxt, last, local = run(body, busy_poll)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert nxt == [7, 8] and last == 9 and local == 4


def test_a_cancelled_caller_drops_the_connection():
    async def body(lane, _):
        task = asyncio.ensure_future(lane(req("slow:5"), timeout=5))
        await asyncio.sleep(0.1)
        first = lane.sock
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await n_of(lane, "ok:3"), first is not None and lane.sock is not first
    assert run(body) == (3, True)


def test_a_service_gone_is_unavailable():
    async def body(lane, child):
        await n_of(lane, "ok:1")
        child.kill()
        child.join()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await n_of(lane, "ok:2")
        return e.value.code()
    assert run(body) == grpc.StatusCode.UNAVAILABLE


def test_a_lane_out_of_reach_means_the_grpc_stream():
    """GetInfo names a lane this process cannot connect to (another network namespace looks the same): the call
    goes on the gRPC stream, and that lane is not tried again."""
    async def body(lane, _):
        got = [await n_of(lane, f"ok:{i}") for i in range(3)]
        return got, lane.local_calls, lane.opened, lane.unreachable
    got, local, opened, unreachable = run(body, lane_name="tandem-nobody-listens-here")
    assert got == [0, 1, 2] and local == 0 and opened == 1 and unreachable == "tandem-nobody-listens-here"


def test_a_lane_serving_another_method_is_refused_at_hello():
    server = LaneServer("tandem.v1.DraftService/Propose", target_pb2.VerifyRequest, None)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(wire.address(server.name))
            s.sendall(wire.frame(wire.HELLO, b"tandem.v1.TargetService/Verify"))
            n, kind = wire.HEADER.unpack(s.recv(wire.HEADER.size))
            code, details = wire.parse_error(s.recv(n))
    finally:
        server.close()
    assert kind == wire.ERROR and code == "FAILED_PRECONDITION"
    assert "tandem.v1.DraftService/Propose" in details and "tandem.v1.TargetService/Verify" in details


def test_a_context_is_inactive_once_its_caller_closed():
    """LaneContext.is_active (a request read after it is false is not run): false once the gateway's end is
    closed, even with its request still unread."""
    a, b = socket.socketpair()
    ctx = LaneContext(b)
    assert ctx.is_active()
    a.sendall(wire.frame(wire.REQUEST, b"x"))
    a.close()
    time.sleep(0.01)
    assert not ctx.is_active()
    b.close()


def test_a_host_without_abstract_sockets_serves_grpc_only(monkeypatch):
    """open_lane: a LaneServer that cannot bind (no abstract Unix sockets: not Linux) leaves the service without a
    lane (GetInfo announces none, the gateway uses the gRPC stream); where it binds, its name is announced."""
    import services.servicer as servicer_mod

    class S(servicer_mod.ServicerBase):
        def lane(self):
            return "tandem.v1.TargetService/Verify", target_pb2.VerifyRequest, lambda r, c: None

    ok = S().open_lane(0.0, 1 << 20)
    try:
        assert ok is not None and ok.name.startswith("tandem-verify-")
    finally:
        ok.close()

    def no_bind(*a, **k):
        raise OSError(97, "Address family not supported by protocol")
    monkeypatch.setattr(servicer_mod, "LaneServer", no_bind)
    s = S()
    assert s.open_lane(0.0, 1 << 20) is None and s.lane_server is None


def test_a_lane_spins_only_after_calls_whose_next_is_urgent():
    """After a call its predicate calls urgent the reader polls without sleeping (CPU busy while idle); after one
    it does not (the draft's collects: services/draft/server.py), it blocks at once."""
    import resource
    import sys

    def idle_cpu(urgent: bool) -> float:
        switch = sys.getswitchinterval()             # a spinning lane lowers it for the process
        lane = LaneServer("tandem.v1.TargetService/Verify", target_pb2.VerifyRequest,
                          lambda req, ctx, received: target_pb2.VerifyResponse(), spin_s=5.0,
                          spin_after=lambda req: urgent)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(wire.address(lane.name))
            sock.sendall(wire.frame(wire.HELLO, lane.method.encode()))
            sock.recv(wire.HEADER.size)
            sock.sendall(wire.frame(wire.REQUEST, target_pb2.VerifyRequest().SerializeToString()))
            sock.recv(wire.HEADER.size)
            time.sleep(0.1)                            # the answer sent; the reader spins or blocks now
            t0 = resource.getrusage(resource.RUSAGE_SELF)
            time.sleep(0.5)
            t1 = resource.getrusage(resource.RUSAGE_SELF)
            return (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime)
        finally:
            sock.close()
            lane.close()
            sys.setswitchinterval(switch)
    assert idle_cpu(False) < 0.05
    assert idle_cpu(True) > 0.1


def test_a_push_is_run_and_not_answered(caplog):
    """A PUSH frame (the target's Propose pushed a round ahead: services/target/ahead.py) runs the call and writes
    nothing back: the first frame on the socket after two pushes is the next REQUEST's answer. A push that fails
    is logged by the lane (nobody reads an answer), and a frame of another kind is still refused."""
    ran = []

    def call(req, ctx, received):
        ran.append(req.items[0].request_id if req.items else "")
        if ran[-1] == "boom":
            raise RuntimeError("the kernel fell over")
        return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(num_accepted=len(ran))])

    lane = LaneServer("tandem.v1.TargetService/Verify", target_pb2.VerifyRequest, call)
    one = lambda rid: target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id=rid)]).SerializeToString()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(wire.address(lane.name))
            s.sendall(wire.frame(wire.HELLO, lane.method.encode()))
            assert wire.HEADER.unpack(s.recv(wire.HEADER.size)) == (0, wire.RESPONSE)
            s.sendall(wire.frame(wire.PUSH, one("a")) + wire.frame(wire.PUSH, one("boom"))
                      + wire.frame(wire.REQUEST, one("c")))
            n, kind = wire.HEADER.unpack(s.recv(wire.HEADER.size))
            answer = target_pb2.VerifyResponse.FromString(s.recv(n))
            s.sendall(wire.frame(9, b""))
            n, refused = wire.HEADER.unpack(s.recv(wire.HEADER.size))
            code, details = wire.parse_error(s.recv(n))
    finally:
        lane.close()
    assert ran == ["a", "boom", "c"]
    assert kind == wire.RESPONSE and answer.results[0].num_accepted == 3
    assert refused == wire.ERROR and code == "INVALID_ARGUMENT" and "kind 9" in details
    assert any("a pushed call failed" in r.message and "the kernel fell over" in r.message for r in caplog.records)


def test_the_draft_lane_spins_only_after_a_propose_the_gateway_sent():
    """A draft's lane polls without sleeping only after a Propose the gateway sent itself: after a push (the next
    is a round away) a spinning reader would take the GIL back from the thread that answers the gateway's collect
    as the push's drafts are done, and after a collect the next call waits for a push anyway."""
    from services.draft.server import DraftServicer
    from tandem.v1 import draft_pb2
    spins = lambda **kw: DraftServicer.lane_spins_after(None, draft_pb2.ProposeRequest(**kw))
    assert spins() and not spins(ahead_id="g-1-ahead") and not spins(collect_ahead_id="g-1-ahead")
