"""GPU: the hidden-row bridge's CUDA IPC transport (target and draft on ONE GPU, two processes).

(a) Two real processes on cuda:0 pair a RowChannel each (both ask for auto: they must settle on
    ipc) and move frames of several row counts in bf16, fp16 and fp32; every frame arrives bitwise
    equal; a take of a transfer never sent is a LookupError and the channel stays in step; rows over
    a ring slot do not fit (the target sends those inline); the draft's checked take (its finiteness
    check enqueued before the take's one sync) passes every frame and refuses one holding a NaN.
(b) `tandem serve --device cuda --draft-device cuda:0 -k 3`: greedy K=3 equals K=0, and a Propose
    whose descriptor disagrees with the draft's bookkeeping over the BRIDGE (IPC) transport is
    INVALID_ARGUMENT naming both counts.

Skipped on machines without CUDA. Run as a script, this file is the worker of (a):
`python tests/test_gpu_bridge.py sender|receiver HOST:PORT`.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # as a script
from bridge_checks import assert_bridge_contract  # noqa: E402
from cluster import REPO, free_ports  # noqa: E402
from gpu_cluster import serve_cuda  # noqa: E402

HIDDEN = 96
CASES = [(1, torch.bfloat16), (7, torch.float32), (64, torch.bfloat16), (0, torch.float32),
         (300, torch.float32), (300, torch.bfloat16), (5, torch.float16), (129, torch.float32)]
SLOT = 1 << 20                   # bytes of one ring slot (8 slots): every case fits; OVERSIZE does not
OVERSIZE = (1024, 512)           # fp32 rows: 2 MiB
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
HELLO = {"model_identity": "sha256:gpu-bridge", "contract_version": "test"}


POISONED = 2                     # CASES[2] holds a NaN at row 5: moved bit for bit, refused by a checked take


def expected_rows(i: int) -> torch.Tensor:
    n, dtype = CASES[i]
    g = torch.Generator().manual_seed(1000 + i)
    return (torch.randn(n, HIDDEN, generator=g) * 3).to(dtype)


def poison(i: int, rows: torch.Tensor) -> torch.Tensor:
    if i == POISONED:
        rows[5, 3] = float("nan")     # written the same way on both sides: the same bits
    return rows


# --- (a) the worker processes --------------------------------------------------------------------------
def _connect(role: str, addr: str):
    from services.bridge.channel import RowChannel
    ch = RowChannel(addr, role, "auto", "cuda:0", timeout_s=60, hello=HELLO, ipc_bytes=8 * SLOT)
    deadline = time.monotonic() + 60
    while not ch.ready and not ch.error and time.monotonic() < deadline:
        time.sleep(0.05)              # polling the channel's background connect
    return ch


def _report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def sender(addr: str) -> None:
    ch = _connect("sender", addr)
    if not ch.ready:
        return _report(error=ch.error or "not ready in 60s")
    big = torch.zeros(*OVERSIZE, device="cuda:0")
    fits_big = ch.fits(big)
    try:
        ch.send(999_999, big)
        refused = ""
    except ValueError as e:
        refused = str(e)
    for i in range(len(CASES)):
        src = expected_rows(i).to("cuda:0")
        rows = torch.zeros_like(src)
        torch.cuda._sleep(20_000_000)  # rows complete only after a while on this stream: send must wait for it
        poison(i, rows.add_(src))
        ch.send(i + 1, rows)
        del rows, src                  # the channel's copy into the slot still runs after this
    _report(transport=ch.transport, fits_big=fits_big, refused=refused)
    sys.stdin.read()                   # hold the slot until the receiver is done


def receiver(addr: str) -> None:
    ch = _connect("receiver", addr)
    if not ch.ready:
        return _report(error=ch.error or "not ready in 60s")
    sys.stdin.readline()               # the sender parked every transfer
    bad = []
    try:
        ch.take(424242, timeout_s=30)
        bad.append("transfer 424242 was never sent, yet take returned rows")
    except LookupError:
        pass
    for i in range(len(CASES)):
        got, want = ch.take(i + 1, timeout_s=30), poison(i, expected_rows(i))
        if got.device != torch.device("cuda:0") or got.dtype != want.dtype or got.shape != want.shape:
            bad.append(f"transfer {i + 1}: got {got.dtype} {tuple(got.shape)} on {got.device}, "
                       f"expected {want.dtype} {tuple(want.shape)} on cuda:0")
        elif not torch.equal(got.cpu().view(BITS[want.dtype]), want.view(BITS[want.dtype])):
            bad.append(f"transfer {i + 1} ({CASES[i][0]} rows of {want.dtype}): bits differ")
        elif i != POISONED and not torch.equal(ch.take(i + 1, timeout_s=30, field=f"t{i + 1}").cpu(), want):
            bad.append(f"transfer {i + 1}: the checked take differs")
        if i != POISONED:                # the take that waits for nothing: its checks after the use
            rows, landed = ch.take_later(i + 1, timeout_s=30, field=f"t{i + 1}")
            copy = rows.clone()                               # a use on the caller's stream
            torch.cuda.current_stream().synchronize()
            landed()
            if not torch.equal(copy.cpu(), want):
                bad.append(f"transfer {i + 1}: take_later differs")
    from services.bridge.rows import ContractError
    rows, landed = ch.take_later(POISONED + 1, timeout_s=30, field="poisoned")
    try:
        landed()
        bad.append("a frame holding a NaN passed take_later's check")
    except ContractError as e:
        if "poisoned holds non-finite values (NaN or inf) in 1 of 64 rows, first at row 5" not in str(e):
            bad.append(f"take_later's check: {e}")
    try:
        ch.take(POISONED + 1, timeout_s=30, field="poisoned")
        bad.append("a frame holding a NaN passed the checked take")
    except ContractError as e:
        if "poisoned holds non-finite values (NaN or inf) in 1 of 64 rows, first at row 5" not in str(e):
            bad.append(f"the checked take's error: {e}")
    _report(transport=ch.transport, bad=bad, taken=len(CASES))


# --- (a) the test ---------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")


class Worker:
    """A worker process with its output read on a thread (RESULT lines parsed, the rest kept for errors)."""

    def __init__(self, role: str, addr: str):
        self.lines: list[str] = []
        self.results: queue.Queue = queue.Queue()
        self.p = subprocess.Popen([sys.executable, __file__, role, addr], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)
            if line.startswith("RESULT "):
                self.results.put(json.loads(line[7:]))

    def result(self, timeout_s: float) -> dict:
        try:
            return self.results.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no result in {timeout_s:.0f}s (exit {self.p.poll()}):\n"
                                 + "".join(self.lines)[-4000:]) from None

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


@needs_cuda
def test_ipc_bridge_between_two_processes_on_one_gpu():
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    snd, rcv = Worker("sender", addr), Worker("receiver", addr)
    try:
        s = snd.result(120)
        assert "error" not in s, s
        assert s["transport"] == "ipc", s
        assert s["fits_big"] is False and "exceed a CUDA IPC ring slot of 1048576 bytes" in s["refused"], s
        rcv.p.stdin.write("go\n")
        rcv.p.stdin.flush()
        r = rcv.result(120)
        assert "error" not in r, (r, "".join(rcv.lines)[-4000:])
        assert r["transport"] == "ipc" and r["taken"] == len(CASES) and not r["bad"], r
        assert rcv.p.wait(timeout=60) == 0, "".join(rcv.lines)[-4000:]
        snd.p.stdin.close()                           # the receiver is gone: the sender may free the slot
        assert snd.p.wait(timeout=60) == 0, "".join(snd.lines)[-4000:]
    finally:
        rcv.stop()
        snd.stop()


# --- (b) tandem serve with target and draft on one GPU --------------------------------------------------
@pytest.fixture(scope="module")
def shared_gpu_cluster(tmp_path_factory):
    with serve_cuda(tmp_path_factory.mktemp("ipc"), ["--draft-device", "cuda:0"]) as stubs:
        yield stubs


@needs_cuda
def test_shared_gpu_bridge_is_ipc_and_contract_fires(shared_gpu_cluster):
    from tandem.v1 import common_pb2, draft_pb2
    _, target, draft, log = shared_gpu_cluster
    rows, item = assert_bridge_contract(target, draft, "ipc-contract", [5, 9, 17, 33, 65, 129])
    text = log.read_text()
    assert "bridge sender connected (ipc, cuda:0, generation 1)" in text and "bridge receiver connected (ipc, cuda:0, generation 1)" in text, \
        text[-4000:]
    good = draft.Propose(draft_pb2.ProposeRequest(items=[item], hidden_rows=[rows]), timeout=30)
    assert len(good.results[0].draft_token_ids) == 2          # the same transfer, taken through the IPC slot
    target.Release(common_pb2.ReleaseRequest(request_ids=["ipc-contract"]), timeout=10)
    draft.Release(common_pb2.ReleaseRequest(request_ids=["ipc-contract"]), timeout=10)


@needs_cuda
def test_shared_gpu_greedy_speculation_equals_plain_decoding(shared_gpu_cluster):
    from tandem.v1 import generate_pb2
    gateway = shared_gpu_cluster[0]
    accepted = 0
    for i in range(5):
        prompt = [(13 * i + 7 * j) % 500 + 3 for j in range(2 + 5 * i)]
        outs = {}
        for k in (0, 3):
            r = gateway.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                 max_tokens=24, ignore_eos=True, num_speculative_tokens=k), timeout=120)
            outs[k] = list(r.token_ids)
            accepted += r.spec_stats.num_accepted_tokens
        assert outs[3] == outs[0], (i, outs)
    assert accepted > 0                      # rounds really accepted drafts, with rows over the IPC bridge


if __name__ == "__main__":
    {"sender": sender, "receiver": receiver}[sys.argv[1]](sys.argv[2])
    sys.stdout.flush()
    os._exit(0)          # the bridge thread still waits in the store; CUDA teardown order is not under test here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="one GPU: two GPUs measure NCCL")
def test_bench_bridge_measures_the_ipc_take(tmp_path):
    """`tandem bench bridge --device cuda` on one GPU: the draft takes each pushed transfer (bitwise checked in
    the worker) and times the take, its finiteness check after it, the checked take (one sync) and a bare copy of
    the same bytes."""
    from tandem.bench_bridge import main
    assert main(["--device", "cuda", "--batches", "1,32", "--warmup", "2", "--iters", "6", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bridge.json").read_text())
    assert [(r["transport"], r["rows"]) for r in rows] == [("ipc", 4), ("ipc", 128)]
    assert all(r["bridge_us"] > 0 and r["bare_us"] > 0 and r["check_us"] > 0 and r["checked_take_us"] > 0
               for r in rows), rows
    assert "checked take (one sync)" in (tmp_path / "bridge.md").read_text()
