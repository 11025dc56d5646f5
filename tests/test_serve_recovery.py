"""`tandem serve` survives its services crashing (target of --tp 2, draft, gateway as processes).

A target rank is SIGKILLed mid-stream (first a worker rank, then rank 0): every in-flight request
ends within 5 s with a clear error (REST: an error event with code "unavailable" then `data: [DONE]`;
gRPC: UNAVAILABLE), never a hung stream; new requests get 503 / UNAVAILABLE while the target is
down; `tandem serve` restarts it (logged, with backoff) and serving resumes through the same
gateway process, with the same greedy output as before the crash. The draft is killed too: the
gateway serves without drafts meanwhile and speculates again once `tandem serve` has restarted it.
After each episode both services hold no request and every KV block is free.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from cluster import REPO, free_ports, make_checkpoint, running, stop_serve
from tandem.v1 import common_pb2, generate_pb2 as gen, generate_pb2_grpc, target_pb2_grpc, draft_pb2_grpc
from test_faults import health, wait_until

pytestmark = pytest.mark.slow

FAIL_FAST_S = 5.0
PROMPT = [21, 22, 23, 24]


class Served:
    """One `tandem serve` process tree on free ports, its combined log in a file."""

    def __init__(self, model, log_path, tp: int = 2, args: tuple = ()):
        ports = free_ports(6)
        self.grpc_port, self.http_port, tport, dport, bport, dist = ports
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tandem", "serve", "--model", str(model), "-k", "3", "--tp", str(tp),
               "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), "--target-port", str(tport),
               "--draft-port", str(dport), "--bridge-port", str(bport), "--dist-port", str(dist), "--num-blocks", "512",
               "--speculation", "fixed", *args]
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        chans = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in (self.grpc_port, tport, dport)]
        self.channels = chans
        self.stub = generate_pb2_grpc.GenerateServiceStub(chans[0])
        self.target = target_pb2_grpc.TargetServiceStub(chans[1])
        self.draft = draft_pb2_grpc.DraftServiceStub(chans[2])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, name: str) -> int:
        """The latest pid `tandem serve` started `name` with."""
        return int(re.findall(rf"started {name} \(pid (\d+)\)", self.log())[-1])

    def wait_healthy(self, timeout_s: float = 240) -> None:
        def ok():
            assert self.proc.poll() is None, f"tandem serve exited:\n{self.log()[-6000:]}"
            try:
                code, body = health(self.url)
                return code == 200 and body["speculation"]["state"] == "active"
            except httpx.HTTPError:
                return False
        try:
            wait_until(ok, timeout_s, "tandem serve healthy", poll_s=0.3)
        except AssertionError as e:               # where each process of the tree is: their stacks into the log
            raise AssertionError(f"{e}\n{self.stacks()}") from None

    def stacks(self, pids: list[int] = ()) -> str:
        """Every thread's stack of `tandem serve` and its processes, or of `pids` and theirs (SIGUSR1: faulthandler,
        tandem/cli.py), and the log's tail they were written to."""
        tree, i = list(pids) or [self.proc.pid], 0
        while i < len(tree):
            tree += children(tree[i])
            i += 1
        for pid in tree:                          # Tandem's own only (SIGUSR1 ends a process without the handler)
            with contextlib.suppress(OSError):
                if "tandem" in cmdline(pid)[1:3]:
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
        return f"processes {tree}\n{self.log()[-16000:]}"

    def idle(self, timeout_s: float = 15) -> None:
        """Both services hold no request and every KV block is free (GetInfo)."""
        def check():
            infos = [s.GetInfo(common_pb2.InfoRequest(), timeout=5) for s in (self.target, self.draft)]
            return all(i.running_requests == 0 and i.kv_blocks_free == i.kv_blocks_total for i in infos)
        wait_until(check, timeout_s, "both services idle with every KV block free")

    def stop(self) -> None:
        stop_serve(self.proc, self.channels)


def serve_for_module(tmp_path_factory, request, name: str, seed: int, **kw):
    """A healthy `tandem serve` of a tiny checkpoint for one test module (yields Served); its log is printed
    when a test of the module failed."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp(f"{name}-ckpt") / "tiny", seed=seed)
    s = Served(ckpt, tmp_path_factory.mktemp(f"{name}-logs") / "serve.log", **kw)
    failed = request.session.testsfailed
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()
        if request.session.testsfailed > failed:
            print(f"\n===== tandem serve log =====\n{s.log()[-12000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    yield from serve_for_module(tmp_path_factory, request, "serve", seed=5)


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except OSError:
            pass
    return out


def cmdline(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline").read().split("\0")


def greedy(stub, max_tokens=12) -> list[int]:
    req = gen.GenerateRequest(max_tokens=max_tokens, ignore_eos=True)
    req.token_ids.ids.extend(PROMPT)
    return list(stub.Generate(req, timeout=60).token_ids)


def rest_stream(url: str, out: list, started: threading.Event) -> None:
    """One REST stream; appends (seconds at its end, its last data line, the error line or None)."""
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    last, err = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                last = line
                err = line if '"error"' in line else err
    out.append((time.monotonic(), last, err))


def grpc_stream(stub, out: list, started: threading.Event) -> None:
    req = gen.GenerateRequest(max_tokens=1500, ignore_eos=True)
    req.token_ids.ids.extend(PROMPT)
    try:
        for _ in stub.GenerateStream(req, timeout=60):
            started.set()
        out.append((time.monotonic(), "finished", None))
    except grpc.RpcError as e:
        out.append((time.monotonic(), e.code(), e.details()))


def grpc_health(served, service: str = "tandem.v1.GenerateService"):
    """The gateway's gRPC health status of `service` (it mirrors REST /health's view of the target)."""
    stub = health_pb2_grpc.HealthStub(served.channels[0])
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


@pytest.mark.parametrize("rank", [1, 0])
def test_target_rank_killed_fails_fast_then_recovers(served, rank):
    want = greedy(served.stub)
    rest, grpc_out, started = [], [], [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=rest_stream, args=(served.url, rest, started[i])) for i in range(2)]
    threads.append(threading.Thread(target=grpc_stream, args=(served.stub, grpc_out, started[2])))
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started), "streams did not start"
    rank0 = served.pid("target")
    victim = rank0 if rank == 0 else next(p for p in children(rank0) if "--rank" in cmdline(p))
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    assert len(rest) == 2 and len(grpc_out) == 1, "a stream hung"
    for end, last, err in rest:
        assert end - killed < FAIL_FAST_S and last == "data: [DONE]", (end - killed, last)
        assert err is not None and '"code": "unavailable"' in err, err
    (end, code, details), = grpc_out
    assert end - killed < FAIL_FAST_S and code == grpc.StatusCode.UNAVAILABLE, (end - killed, code, details)

    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text     # still down: refused at once
    with pytest.raises(grpc.RpcError) as e:
        greedy(served.stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health(served.url)[0] == 503
    assert grpc_health(served) == health_pb2.HealthCheckResponse.NOT_SERVING    # gRPC health says so too

    served.wait_healthy(120)                                     # tandem serve restarted it; same gateway
    assert greedy(served.stub) == want
    assert grpc_health(served) == health_pb2.HealthCheckResponse.SERVING
    served.idle()
    exit_code = 75 if rank else -9                               # 75: a rank 0 whose group broke exits
    assert f"target exited with code {exit_code}; restarting it" in served.log()


def test_draft_killed_under_serve_resumes_speculation(served):
    want = greedy(served.stub)
    os.kill(served.pid("draft"), signal.SIGKILL)
    wait_until(lambda: health(served.url)[1]["speculation"]["state"] == "degraded", 10, "degraded")
    assert greedy(served.stub) == want                           # served without drafts meanwhile
    served.wait_healthy(120)
    req = gen.GenerateRequest(max_tokens=12, ignore_eos=True)
    req.token_ids.ids.extend(PROMPT)
    resp = served.stub.Generate(req, timeout=60)
    assert list(resp.token_ids) == want and resp.spec_stats.num_drafts > 0
    served.idle()
    assert "draft exited with code -9; restarting it" in served.log()


def test_services_end_when_serve_is_killed(tmp_path):
    """`tandem serve` killed by SIGKILL (no handler runs): its target, draft and gateway end too (they get SIGTERM
    from the kernel when their parent dies) instead of running on, holding the cluster's ports (found probing as an
    operator)."""
    s = Served(make_checkpoint(tmp_path / "tiny", seed=9), tmp_path / "serve.log", tp=1)
    try:
        s.wait_healthy()
        kids = children(s.proc.pid)
        assert len(kids) == 3, [cmdline(k) for k in kids]
        names = {k: " ".join(cmdline(k)[1:4]) for k in kids}

        def still() -> list[str]:                        # (cluster.running: a zombie has ended)
            out = []
            for k in (k for k in kids if running(k)):
                with contextlib.suppress(OSError):
                    out.append(f"{names[k]} (pid {k}): {open(f'/proc/{k}/wchan').read()}")
            return out
        s.proc.kill()
        s.proc.wait(timeout=10)
        try:
            wait_until(lambda: not still(), 30, "the services to end with their parent")
        except AssertionError as e:                      # which one, and what its log says (CI: a stop signal that
            # landed on another thread, fixed in infra/grpc_server.py; tests/test_shutdown.py), with every thread's
            # stack of those still running (SIGUSR1: faulthandler, written without the GIL; tandem/cli.py)
            raise AssertionError(f"{e}: still running {still()}\n{s.stacks(kids)}") from None
    finally:
        s.stop()


def test_serve_exits_non_zero_when_it_gives_up_on_a_process(tmp_path):
    """Past --max-restarts `tandem serve` stops the cluster and exits 1, so that its own supervisor (systemd,
    Docker's restart on failure) sees a failure; it exited 0 (found probing as an operator). Ctrl-C stays 0."""
    s = Served(make_checkpoint(tmp_path / "tiny", seed=9), tmp_path / "serve.log", tp=1, args=("--max-restarts", "0"))
    try:
        s.wait_healthy()
        os.kill(s.pid("draft"), signal.SIGKILL)
        assert s.proc.wait(timeout=60) == 1, s.log()[-2000:]
        assert "--max-restarts 0" in s.log()
    finally:
        s.stop()
