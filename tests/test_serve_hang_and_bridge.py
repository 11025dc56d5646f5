"""`tandem serve` (target, draft, gateway as processes, K = 3, the gloo bridge on CPU) through two faults.

A draft SIGKILLed and restarted by `tandem serve`: rows go inline while it is gone, and back on the
bridge once the new draft joined the target's store (bridge generation 2 on both sides); /health and
`tandem:hidden_transport_info` say "inline", then "bridge:shm" again, `tandem:speculation_active` 0
then 1; greedy output after the restart equals K = 0, with drafts.

A target that hangs (SIGSTOP) mid-stream: the gateway's health watch (1 s deadline, 3 misses) finds it
within 4.5 s, so the in-flight streams end with UNAVAILABLE (REST: an `unavailable` error event, then
`data: [DONE]`) within HANG_FAIL_S of the SIGSTOP, not after --rpc-timeout (60 s); new requests get
503 / UNAVAILABLE while it hangs; `tandem serve`'s own probe kills it and restarts it; the same gateway
then serves the same greedy output, and the bridge is rebuilt with the new target.

The first test runs the scheduler in process: target_lost cuts the Verify it awaits.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import httpx
import pytest

from tandem.v1 import common_pb2, generate_pb2 as gen
from test_faults import health, metric, wait_until
from test_scheduler_faults import FakeDraft, FakeTarget, events, request
from test_serve_recovery import PROMPT, Served, grpc_stream, rest_stream, serve_for_module

HANG_FAIL_S = 6.0        # the watch's 4.5 s worst case, and a busy 2-core machine's slack


def test_a_lost_target_cuts_the_call_in_flight():
    from gateway.scheduler import Scheduler

    class HungTarget(FakeTarget):
        async def Verify(self, req, timeout=None):
            await asyncio.sleep(3600)              # no answer, no error: as a SIGSTOPped process

    async def main():
        s = Scheduler(HungTarget(), FakeDraft(), {2}, rpc_timeout_s=60.0)
        r = request(s)
        s.submit(r)
        round_ = asyncio.ensure_future(s.step())  # Prefill, Propose, then the Verify that hangs
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        s.target_lost("target health check: DEADLINE_EXCEEDED")
        await asyncio.wait_for(round_, 1.0)
        code, message = events(r)[-1].error
        assert code == grpc.StatusCode.UNAVAILABLE and "DEADLINE_EXCEEDED" in message and r.finished
        assert time.monotonic() - t0 < 0.5 and not s.running
        assert s.avail.admit(1, 0)[0] == grpc.StatusCode.UNAVAILABLE
    asyncio.run(main())


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    yield from serve_for_module(tmp_path_factory, request, "hang", seed=11, tp=1)


def generate(stub, k: int | None = None) -> gen.GenerateResponse:
    req = gen.GenerateRequest(max_tokens=12, ignore_eos=True)
    if k is not None:
        req.num_speculative_tokens = k
    req.token_ids.ids.extend(PROMPT)
    return stub.Generate(req, timeout=60)


def transport_metric(url: str) -> str:
    """The `transport` label of tandem:hidden_transport_info (its one series)."""
    line, = [x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
             if x.startswith("tandem:hidden_transport_info{")]
    return line.split('transport="')[1].split('"')[0]


def bridge(s: Served) -> list[tuple[str, int]]:
    """(transport, generation) of the bridge as target and draft report it (GetInfo)."""
    infos = [x.GetInfo(common_pb2.InfoRequest(), timeout=5) for x in (s.target, s.draft)]
    return [(i.hidden_transport, i.bridge_generation) for i in infos]


def on_bridge(url: str) -> bool:
    code, body = health(url)
    return code == 200 and body["speculation"]["state"] == "active" and body["hidden_transport"] == "bridge:shm"


def test_bridge_comes_back_after_a_draft_restart(served):
    url = served.url
    want = list(generate(served.stub, k=0).token_ids)                # the reference: K = 0
    wait_until(lambda: on_bridge(url), 30, "rows on the bridge at start")
    first = bridge(served)
    assert first[0] == first[1] and first[0][0] == "shm", first
    assert transport_metric(url) == "bridge:shm" and metric(url, "tandem:speculation_active") == 1

    os.kill(served.pid("draft"), signal.SIGKILL)
    wait_until(lambda: health(url)[1]["speculation"]["state"] == "degraded", 10, "degraded")
    assert health(url)[1]["hidden_transport"] == "inline" and transport_metric(url) == "inline"
    assert metric(url, "tandem:speculation_active") == 0
    assert list(generate(served.stub).token_ids) == want             # served without drafts meanwhile

    wait_until(lambda: on_bridge(url), 90, "speculation active and rows on the bridge again")
    assert bridge(served) == [("shm", first[0][1] + 1)] * 2         # a new generation on both sides
    assert transport_metric(url) == "bridge:shm" and metric(url, "tandem:speculation_active") == 1
    resp = generate(served.stub)
    assert list(resp.token_ids) == want and resp.spec_stats.num_drafts > 0
    served.idle()
    assert "draft exited with code -9; restarting it" in served.log()


def stopped(pid: int) -> bool:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"


def test_hung_target_fails_fast_then_is_restarted(served):
    want = list(generate(served.stub).token_ids)
    rest, grpc_out, started = [], [], [threading.Event() for _ in range(2)]
    threads = [threading.Thread(target=rest_stream, args=(served.url, rest, started[0])),
               threading.Thread(target=grpc_stream, args=(served.stub, grpc_out, started[1]))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started), "streams did not start"
    pid = served.pid("target")
    os.kill(pid, signal.SIGSTOP)
    hung = time.monotonic()
    try:
        for t in threads:
            t.join(timeout=30)
        assert len(rest) == 1 and len(grpc_out) == 1, "a stream hung"
        (end, last, err), = rest
        assert end - hung < HANG_FAIL_S and last == "data: [DONE]", (end - hung, last)
        assert err is not None and '"code": "unavailable"' in err, err
        (end, code, details), = grpc_out
        assert end - hung < HANG_FAIL_S and code == grpc.StatusCode.UNAVAILABLE, (end - hung, code, details)
        print(f"streams ended {rest[0][0] - hung:.1f}s (REST) and {end - hung:.1f}s (gRPC) after the SIGSTOP")

        r = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text      # refused while it hangs
        with pytest.raises(grpc.RpcError) as e:
            generate(served.stub)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stopped(pid), "the target was restarted before the refusals were checked"
    except BaseException:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)    # let the cluster serve the tests that follow
        raise

    wait_until(lambda: "it is hung; killing it (SIGKILL)" in served.log(), 30, "tandem serve killed the hung target")
    served.wait_healthy(120)                                           # restarted; the same gateway
    assert list(generate(served.stub).token_ids) == want
    wait_until(lambda: on_bridge(served.url), 60, "the bridge rebuilt with the new target")
    served.idle()
    assert "target exited with code -9; restarting it" in served.log()
