"""A gateway that is told to stop (SIGTERM; Ctrl-C outside `tandem serve`) drains: it refuses new requests at once
(gRPC UNAVAILABLE / HTTP 503 naming the shutdown, /health 503), lets the requests it holds run to their end for at
most --drain-timeout, then fails what is left with UNAVAILABLE, so a REST stream ends with an error event rather
than a cut connection; it exits 0 and the services hold nothing after. (Found probing as an operator: every stop
cut every stream mid-response, with no error event.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from cluster import Cluster, Proc, free_ports, make_checkpoint, running, serve_module
from tandem.v1 import generate_pb2 as gen, generate_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("shutdown-ckpt") / "tiny", seed=9)
    with Cluster(ckpt, k=2, log_dir=tmp_path_factory.mktemp("shutdown-logs")) as c:
        yield from serve_module(c, request)


def own_gateway(c: Cluster, name: str, drain_s: float):
    """Another gateway on the cluster's services (not the cluster's: the test stops it) -> (Proc, stub, REST url)."""
    gport, hport = free_ports(2)
    cmd = list(c.procs[-1].cmd)
    for flag, port in (("--grpc-port", gport), ("--http-port", hport)):
        cmd[cmd.index(flag) + 1] = str(port)
    p = Proc(name, cmd + ["--drain-timeout", str(drain_s)], f"127.0.0.1:{gport}", c.log_dir / f"{name}.log")
    c._spawn(p)
    c.procs.remove(p)                          # its exit is the test's, not a fault of the cluster
    c.wait_serving(p, time.monotonic() + 60)
    return p, generate_pb2_grpc.GenerateServiceStub(c.channel(p.addr)), f"http://127.0.0.1:{hport}"


def request(n: int, prompt=(5, 6, 7)) -> gen.GenerateRequest:
    return gen.GenerateRequest(token_ids=gen.TokenIds(ids=list(prompt)), max_tokens=n, ignore_eos=True)


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(cluster):
    p, stub, url = own_gateway(cluster, "gateway-drains", drain_s=120)
    stream, got = stub.GenerateStream(request(300), timeout=300), []
    got += next(iter(stream)).token_ids
    p.popen.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as e:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:        # (the signal is handled within a moment)
            stub.Generate(request(4, (8, 9)), timeout=30)
            time.sleep(0.05)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details(), e.value
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 503 and "shutting down" in r.json()["reason"], r.text
    for m in stream:                               # the request it held runs to its end
        got += m.token_ids
    assert len(got) == 300
    assert p.popen.wait(timeout=30) == 0
    cluster.wait_drained(timeout_s=30)


def test_past_the_drain_timeout_a_rest_stream_ends_with_an_error_event(cluster):
    p, stub, url = own_gateway(cluster, "gateway-stops", drain_s=1)
    body = {"prompt": [11, 12, 13], "max_tokens": 1900, "ignore_eos": True, "stream": True, "temperature": 0}
    events, signalled = [], threading.Event()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3 and not signalled.is_set():
                signalled.set()
                p.popen.send_signal(signal.SIGTERM)
    assert signalled.is_set() and events[-1] == "[DONE]", events[-3:]
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["code"] == "unavailable" and "shutting down" in errors[0]["message"], errors
    texts = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-2])
    assert texts < 1900, "the stream should have been stopped by the shutdown, not run to its end"
    assert p.popen.wait(timeout=30) == 0
    cluster.wait_drained(timeout_s=30)


def _signal_another_thread(pid: int, sig: int) -> None:
    """`sig` to a thread of `pid` other than its main one that does not block it (the kernel hands a signal sent to
    a thread to that thread); the next such thread where one ended meanwhile."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            status = open(f"/proc/{pid}/task/{tid}/status").read()
            blocked = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigBlk:")), 16)
            if tid != pid and not blocked & (1 << (sig - 1)):
                return os.kill(tid, sig)
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"no thread of {pid} but its main one takes signal {sig}")


def test_a_service_stops_when_its_signal_lands_on_another_thread(cluster):
    """The kernel may deliver a SIGTERM to any thread of a service; Python runs the handler in the main thread,
    which waited for it without a timeout and never woke (CI: a target in futex_do_wait 30 s after `tandem serve`
    was SIGKILLed). Sent to another thread on purpose, the target and the draft stop within a moment, exit 0."""
    procs = []
    for role in ("target", "draft"):
        port, dist = free_ports(2)
        cmd = [sys.executable, "-m", "tandem", role, "--model", str(cluster.model), "--threads", "1",
               "--hidden-transport", "inline", "--grpc-port", str(port), "--dist-addr", f"127.0.0.1:{dist}",
               "--num-blocks", "64"]
        p = Proc(f"{role}-signalled", cmd, f"127.0.0.1:{port}", cluster.log_dir / f"{role}-signalled.log")
        cluster._spawn(p)
        cluster.procs.remove(p)                  # its exit is the test's, not a fault of the cluster
        procs.append(p)
    try:
        for p in procs:
            cluster.wait_serving(p, time.monotonic() + 60)
        for p in procs:
            _signal_another_thread(p.popen.pid, signal.SIGTERM)
        for p in procs:
            try:
                rc = p.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{p.name} still running 15 s after a SIGTERM to one of its threads (main "
                                     f"thread in {open(f'/proc/{p.popen.pid}/wchan').read()})\n{p.tail()}") from None
            assert rc == 0 and "stopped" in p.log.read_text(), p.tail()
    finally:                                     # nothing left running, whatever failed
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait(timeout=10)


ORPHAN = """import os, subprocess, sys, time
server, log, die_with_parent = sys.argv[1:]
child = subprocess.Popen([sys.executable, "-c", server], stderr=open(log, "w"), stdout=subprocess.DEVNULL,
                         env={**os.environ, die_with_parent: "1"})
while "serving" not in open(log).read():
    time.sleep(0.05)
print(child.pid, flush=True)                      # and exit: the child is an orphan now
"""
SERVER = """import logging; logging.basicConfig(level=logging.INFO)
from infra.grpc_server import serve
serve(lambda server: None, [], "127.0.0.1", 0)
"""


def test_a_service_whose_parent_died_stops_without_its_death_signal(tmp_path):
    """Under `tandem serve` a service stops when its parent dies: the kernel's SIGTERM (PR_SET_PDEATHSIG), and, were
    that signal never to run its handler (CI, once: a draft running on 30 s after `tandem serve` was SIGKILLed, its
    handler never run), the serving loop's own check of its parent. Here no death signal is set at all: the server
    must see its parent gone by itself, say so, and stop."""
    from infra.defaults import DIE_WITH_PARENT
    log = tmp_path / "server.log"
    out = subprocess.run([sys.executable, "-c", ORPHAN, SERVER, str(log), DIE_WITH_PARENT], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    pid = int(out.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(pid):
        time.sleep(0.1)
    alive = running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert not alive, f"the orphaned server still runs 10 s after its parent exited\n{text[-2000:]}"
    assert "has exited; stopping" in text and "stopped" in text, text[-2000:]


def test_sigusr1_writes_every_threads_stack_and_the_service_serves_on(cluster):
    """`kill -USR1 PID` writes every thread's stack to a service's log (faulthandler: no GIL needed, so a process
    whose threads are stuck can say where) and changes nothing else."""
    p = next(p for p in cluster.procs if p.name == "draft")
    before = len(p.log.read_text())
    os.kill(p.popen.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "File " not in p.log.read_text()[before:]:
        time.sleep(0.1)
    dump = p.log.read_text()[before:]
    assert "Thread 0x" in dump and "infra/grpc_server.py" in dump, dump[-2000:]
    assert p.popen.poll() is None
    cluster.wait_serving(p, time.monotonic() + 10)


def test_stop_signals_in_quick_succession_stop_a_service_cleanly(tmp_path):
    """A SIGKILLed `tandem serve` can send its services SIGTERM more than once (the kernel hands them from a dying
    thread of it to one still alive and sends the death signal at each hand-over). A handler that ran while the one
    before it held the lock it takes (threading.Event's) deadlocked the process for good (CI: a draft in futex_do_wait
    30 s after `tandem serve` was SIGKILLed, its stacks showing three handlers nested in Event.set). Eight SIGTERMs
    50 us apart, to each of four servers waiting for a stop: before the fix the test hung 5 runs of 5; each must stop,
    log it, exit 0."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    logs = [tmp_path / f"server{i}.log" for i in range(4)]
    procs = []
    for log in logs:
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", SERVER], stderr=f, stdout=subprocess.DEVNULL, env=env))
    try:
        for p, log in zip(procs, logs):
            deadline = time.monotonic() + 60
            while "serving" not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert p.poll() is None and "serving" in log.read_text(), log.read_text()[-2000:]
        time.sleep(0.5)                                  # each main thread waiting for a stop, as a service's does
        for p in procs:
            for _ in range(8):
                os.kill(p.pid, signal.SIGTERM)
                t = time.perf_counter()
                while time.perf_counter() - t < 50e-6:
                    pass
        for p, log in zip(procs, logs):
            try:
                rc = p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running 10 s after eight SIGTERMs (main thread in "
                                     f"{open(f'/proc/{p.pid}/wchan').read()})\n{log.read_text()[-3000:]}") from None
            assert rc == 0 and "stopped" in log.read_text(), (rc, log.read_text()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
