"""The hidden-row bridge comes back after either end restarts (services/bridge/generations.py), with the
other end in a real process that is SIGKILLed and started again: shared memory on CPU (asked for as
`auto`) and gloo (asked for); with CUDA also CUDA IPC (both ends on one GPU) and NCCL (two GPUs), as `auto`, and
gloo between two processes on one GPU (the push's CUDA stream handling; NCCL refuses two ranks on one GPU).

A draft that restarts joins the next generation; the target leaves the old one and pairs with it (the
same handshake as at start-up), and rows move again. A target that restarts hosts a new store; the
draft notices within its keepalive, connects to it and joins again. Each channel's `state()` (what
GetInfo reports) says which transport is connected in which generation.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.bridge.channel import RowChannel
from services.bridge.rows import CONTRACT_VERSION

REPO = Path(__file__).resolve().parent.parent
HELLO = {"model_identity": "sha256:gen", "contract_version": CONTRACT_VERSION}
ROWS = torch.arange(12, dtype=torch.float32).view(3, 4)
GPUS = torch.cuda.device_count()
PAIRS = [pytest.param("cpu", "cpu", "auto", "shm", id="shm"),  # (target's device, draft's, asked, the transport)
         pytest.param("cpu", "cpu", "gloo", "gloo", id="gloo"),
         pytest.param("cuda:0", "cuda:0", "auto", "ipc", id="ipc", marks=pytest.mark.skipif(GPUS < 1, reason="needs CUDA")),
         pytest.param("cuda:0", "cuda:0", "gloo", "gloo", id="gloo-cuda",    # the push's CUDA streams, on one GPU
                      marks=pytest.mark.skipif(GPUS < 1, reason="needs CUDA")),
         pytest.param("cuda:0", "cuda:1", "auto", "nccl", id="nccl",
                      marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs"))]
PEER = """
import sys, time, torch
from services.bridge.channel import RowChannel
from test_bridge_generations import HELLO, ROWS, take
role, addr, tid, device, want = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
ch = RowChannel(addr, role, want, device, hello=HELLO, timeout_s=60)
while not ch.ready:
    time.sleep(0.05)
if role == "sender":
    ch.send(tid, ROWS.to(device))
else:
    print("took", take(ch, tid).cpu().tolist(), flush=True)
print("generation", ch.generation, flush=True)
time.sleep(600)
"""


def take(ch: RowChannel, tid: int) -> torch.Tensor:
    """Take transfer `tid` once the other end sent it (until then the target answers NOT_FOUND)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return ch.take(tid, timeout_s=20)
        except LookupError:
            assert time.monotonic() < deadline, f"transfer {tid} never came"
            time.sleep(0.05)


def address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def peer(role: str, addr: str, tid: int, device: str, want: str) -> subprocess.Popen:
    """The other end in its own process: connects, sends or takes transfer `tid`, then idles."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", PEER, role, addr, str(tid), device, want], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.05)        # polling the channel's background (re)connect


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)


@pytest.mark.parametrize("target_dev, draft_dev, want, transport", PAIRS)
def test_the_target_pairs_with_a_restarted_draft(target_dev, draft_dev, want, transport):
    addr = address()
    target = RowChannel(addr, "sender", want, target_dev, hello=HELLO, timeout_s=60)
    draft = peer("receiver", addr, 1, draft_dev, want)
    try:
        until(lambda: target.state() == (transport, 1), 60, "the first draft connected (generation 1)")
        target.send(1, ROWS.to(target_dev))
        assert draft.stdout.readline().strip() == f"took {ROWS.tolist()}"
        kill(draft)
        draft = peer("receiver", addr, 2, draft_dev, want)    # the same address, as `tandem serve` restarts it
        until(lambda: target.state() == (transport, 2), 60, "the restarted draft connected (generation 2)")
        target.send(2, ROWS.to(target_dev))
        assert draft.stdout.readline().strip() == f"took {ROWS.tolist()}"
        assert draft.stdout.readline().strip() == "generation 2"
    finally:
        kill(draft)
        target.close()                  # its threads stop (none is left to wake during interpreter exit)


@pytest.mark.parametrize("target_dev, draft_dev, want, transport", PAIRS)
def test_the_draft_joins_a_restarted_target(target_dev, draft_dev, want, transport):
    addr = address()
    target = peer("sender", addr, 1, target_dev, want)
    draft = None
    try:
        draft = RowChannel(addr, "receiver", want, draft_dev, hello=HELLO, timeout_s=60)
        until(lambda: draft.ready, 60, "connected")
        assert draft.transport == transport and torch.equal(take(draft, 1).cpu(), ROWS)
        kill(target)
        until(lambda: not draft.ready, 10, "the draft saw its target go")
        target = peer("sender", addr, 7, target_dev, want)    # a new store on the same port: generations start at 1
        until(lambda: draft.state() == (transport, 1), 60, "joined the restarted target")
        assert torch.equal(take(draft, 7).cpu(), ROWS)
    finally:
        if draft is not None:
            draft.close()
        kill(target)


def test_a_draft_that_stops_receiving_does_not_hold_the_target(monkeypatch):
    """gloo / NCCL push: a draft that stops receiving (SIGSTOP: alive, its drain thread frozen) leaves a push in
    flight; after push.PUSH_TIMEOUT_S the target ends that generation (NCCL: aborted) and pairs with the next
    draft, whose rows move. Without the timeout the target's push thread waits on the frozen draft for good."""
    from services.bridge import push
    monkeypatch.setattr(push, "PUSH_TIMEOUT_S", 1.0)
    addr = address()
    target = RowChannel(addr, "sender", "gloo", "cpu", hello=HELLO, timeout_s=60)
    draft = peer("receiver", addr, 1, "cpu", "gloo")
    try:
        until(lambda: target.state() == ("gloo", 1), 60, "the first draft connected (generation 1)")
        target.send(1, ROWS)
        assert draft.stdout.readline().strip() == f"took {ROWS.tolist()}"
        draft.send_signal(signal.SIGSTOP)
        target.send(2, torch.zeros(4096, 4096))       # 64 MiB: more than the socket buffers, so the push waits
        until(lambda: target.state() == ("", 1), 10, "the target left the frozen draft's generation")
        kill(draft)
        draft = peer("receiver", addr, 3, "cpu", "gloo")
        until(lambda: target.state() == ("gloo", 2), 60, "the next draft connected (generation 2)")
        target.send(3, ROWS)
        assert draft.stdout.readline().strip() == f"took {ROWS.tolist()}"
    finally:
        kill(draft)
        target.close()
