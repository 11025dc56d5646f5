"""Which transport the hidden-row bridge uses (services/bridge/channel.py `choose_transport`), on CPU.

Both sides publish an endpoint record (requested transport, device, GPU UUID, process) and compute the
choice from the same two records: gloo on CPU, NCCL across two GPUs, CUDA IPC on one GPU shared by two
processes. Contradicting explicit choices, or a choice the devices cannot carry, fail naming both
sides. `tandem serve` places the draft (--draft-device) and passes the choice on. The IPC transport
itself needs CUDA: tests/test_gpu_bridge.py.
"""
from __future__ import annotations

import math
import os
import time

import pytest
import torch

from bridge_checks import channel_pair, close_channels  # noqa: F401 (close_channels: autouse)
from services.bridge.channel import RowChannel
from services.bridge.transport import TransportError, choose_transport, endpoint
from services.bridge.rows import CONTRACT_VERSION, DTYPE_TO_PB, PB_TO_DTYPE
from services.bridge.shm import ShmReceiver, ShmSender, shm_identity
from services.config import ServiceConfig
from tandem import serve

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


def ep(requested="auto", device="cpu", uuid="", process="host:1", shm="", tso=True):
    return {"requested": requested, "device": device, "uuid": uuid, "process": process, "shm": shm, "tso": tso}


SHM = "boot:42:7"                               # one /dev/shm (shm.shm_identity)


@pytest.mark.parametrize("sender, receiver, want", [
    (ep(), ep(process="host:2"), "gloo"),                                           # both CPU, no /dev/shm
    (ep(shm=SHM), ep(process="host:2", shm=SHM), "shm"),                            # both CPU, one /dev/shm
    (ep(shm=SHM), ep(process="host:2", shm="boot:42:8"), "gloo"),                   # a container's own /dev/shm
    (ep(shm=SHM), ep(shm=SHM), "gloo"),                                             # one process
    (ep(shm=SHM, tso=False), ep(process="host:2", shm=SHM), "gloo"),                # not x86-64
    (ep("gloo", shm=SHM), ep(process="host:2", shm=SHM), "gloo"),
    (ep(device="cuda:0", uuid=GPU_A, shm=SHM), ep(process="host:2", shm=SHM), "gloo"),   # a GPU side
    (ep(device="cuda:0", uuid=GPU_A), ep(device="cuda:1", uuid=GPU_B, process="host:2"), "nccl"),
    (ep(device="cuda:0", uuid=GPU_A), ep(device="cuda:0", uuid=GPU_A, process="host:2"), "ipc"),
    # the same physical GPU under different process-visible indices is still one GPU
    (ep(device="cuda:1", uuid=GPU_A), ep(device="cuda:0", uuid=GPU_A, process="host:2"), "ipc"),
    # the same index naming different GPUs (different CUDA_VISIBLE_DEVICES) is two GPUs
    (ep(device="cuda:0", uuid=GPU_A), ep(device="cuda:0", uuid=GPU_B, process="host:2"), "nccl"),
    (ep(device="cuda:0", uuid=GPU_A), ep(device="cpu", process="host:2"), "gloo"),            # mixed: staged
    (ep(device="cuda:0", uuid=GPU_A), ep(device="cuda:0", uuid=GPU_A), "gloo"),             # one process
    # an explicit choice on one side wins over auto on the other
    (ep("gloo", device="cuda:0", uuid=GPU_A), ep(device="cuda:1", uuid=GPU_B, process="host:2"), "gloo"),
    (ep(device="cuda:0", uuid=GPU_A), ep("ipc", device="cuda:0", uuid=GPU_A, process="host:2"), "ipc"),
    (ep("nccl", device="cuda:0", uuid=GPU_A), ep("nccl", device="cuda:1", uuid=GPU_B, process="host:2"), "nccl"),
])
def test_choice(sender, receiver, want):
    assert choose_transport(sender, receiver) == want
    assert choose_transport(dict(sender), dict(receiver)) == want        # a pure function of the two records


@pytest.mark.parametrize("sender, receiver, match", [
    (ep("gloo"), ep("nccl", process="host:2"),
     r"different hidden-row transports: target --hidden-transport gloo on cpu .*, draft --hidden-transport nccl"),
    (ep("nccl", device="cuda:0", uuid=GPU_A), ep(device="cuda:0", uuid=GPU_A, process="host:2"),
     r"nccl hidden transport needs target and draft on two different GPUs.*GPU-aaaa.*GPU-aaaa"),
    (ep("nccl"), ep(process="host:2"), r"nccl hidden transport needs"),
    (ep(device="cuda:0", uuid=GPU_A), ep("ipc", device="cuda:1", uuid=GPU_B, process="host:2"),
     r"ipc hidden transport needs target and draft on the same GPU.*target --hidden-transport auto on cuda:0 "
     r"\(GPU GPU-aaaa\), draft --hidden-transport ipc on cuda:1 \(GPU GPU-bbbb\)"),
    (ep("ipc", device="cuda:0", uuid=GPU_A), ep("ipc", device="cuda:0", uuid=GPU_A), r"in two processes"),
    (ep("carrier-pigeon"), ep(process="host:2"), r"target asks for hidden transport 'carrier-pigeon'"),
    (ep("shm", shm=SHM), ep(process="host:2", shm="boot:42:8"), r"shm hidden transport needs .* share /dev/shm"),
    (ep("shm", device="cuda:0", uuid=GPU_A, shm=SHM), ep(process="host:2", shm=SHM), r"shm hidden transport"),
])
def test_refusals_name_both_sides(sender, receiver, match):
    with pytest.raises(TransportError, match=match):
        choose_transport(sender, receiver)


def test_endpoint_of_a_cpu_side():
    e = endpoint("auto", "cpu")
    assert e["requested"] == "auto" and e["device"] == "cpu" and e["uuid"] == "" and ":" in e["process"]
    assert e["shm"] == shm_identity() and e["shm"].count(":") >= 2      # this machine has a /dev/shm


def test_shared_memory_ring_carries_frames_and_reports_overwritten_ones():
    sender = ShmSender(capacity=8 * 4096, slots=8)
    receiver = ShmReceiver(sender.spec().encode())
    names = {sender.shm.name, sender.headers.name}
    try:
        frames = {1: torch.randn(5, 8).to(torch.bfloat16), 2: torch.zeros(0, 8), 3: torch.randn(100, 8)}
        for tid, rows in frames.items():
            sender.push(tid, rows, DTYPE_TO_PB[rows.dtype])
        for tid, rows in frames.items():
            payload, code = receiver.take(tid)
            got = payload.view(PB_TO_DTYPE[code]).reshape(rows.shape)
            assert got.dtype == rows.dtype and torch.equal(got, rows)
        sender.push(11, torch.ones(2, 8), DTYPE_TO_PB[torch.float32])    # slot 3 again: transfer 3 is gone
        assert receiver.take(3) is None and receiver.take(11) is not None and receiver.take(19) is None
        assert sender.fits(4096) and not sender.fits(4097)
        with pytest.raises(ValueError, match="do not fit a shared-memory slot of 4096 bytes"):
            sender.push(4, torch.zeros(129, 8), DTYPE_TO_PB[torch.float32])
    finally:
        receiver.close()
        sender.close()
    assert not names & set(os.listdir("/dev/shm"))                                 # the owner unlinked both


def test_a_ring_take_waits_for_a_transfer_not_yet_pushed():
    """The target pushes the next round's Propose before the rows it names (services/target/server.py), so the
    draft's take_later waits (up to channel.RING_WAIT_S) for a transfer its slot does not hold yet; one the slot
    has already moved past (a later id) is gone at once; one that never comes is None after the wait."""
    import threading
    import time
    sender = ShmSender(capacity=8 * 4096, slots=8)
    receiver = ShmReceiver(sender.spec().encode())
    try:
        sender.push(1, torch.ones(2, 8), DTYPE_TO_PB[torch.float32])
        late = threading.Timer(0.2, sender.push, (9, torch.full((3, 8), 9.0), DTYPE_TO_PB[torch.float32]))
        late.start()                                     # slot 1 holds transfer 1 until then
        t0 = time.perf_counter()
        assert receiver.take(9) is None                  # without a wait: not there
        payload, code = receiver.take(9, wait_s=10.0)
        waited = time.perf_counter() - t0
        assert torch.equal(payload.view(PB_TO_DTYPE[code]).reshape(3, 8), torch.full((3, 8), 9.0))
        assert 0.15 < waited < 5.0, waited
        t0 = time.perf_counter()
        assert receiver.take(1, wait_s=10.0) is None     # slot 1 moved on to 9: 1 is gone, no wait
        assert time.perf_counter() - t0 < 1.0
        t0 = time.perf_counter()
        assert receiver.take(10, wait_s=0.3) is None     # slot 2 never holds it
        assert 0.25 < time.perf_counter() - t0 < 5.0
        late.join()
    finally:
        receiver.close()
        sender.close()


# --- the channel agrees on CPU ------------------------------------------------------------------------
def pair(sender_backend: str, receiver_backend: str):
    hello = {"model_identity": "sha256:aaaa", "contract_version": CONTRACT_VERSION}
    return channel_pair(hello, dict(hello), sender_backend, receiver_backend)


def test_auto_on_cpu_is_gloo_and_carries_empty_and_bf16_frames():
    sender, receiver = pair("auto", "auto")
    assert sender.ready and receiver.ready, (sender.error, receiver.error)
    assert sender.transport == receiver.transport == "gloo"
    frames = {1: torch.randn(5, 8).to(torch.bfloat16), 2: torch.zeros(0, 8), 3: torch.randn(300, 8)}
    for tid, rows in frames.items():
        assert sender.fits(rows)                 # only the CUDA IPC slot is bounded
        sender.send(tid, rows)
    for tid, rows in frames.items():
        got = receiver.take(tid, timeout_s=10)
        assert got.dtype == rows.dtype and got.shape == rows.shape and torch.equal(got, rows)


def test_landed_rows_are_bounded_oldest_dropped_first(monkeypatch):
    """gloo / NCCL push every transfer; the draft keeps those it has not taken (rows of a request its policy keeps
    at k = 0 are never taken): past PARK_MAX_BYTES the oldest go, a take of dropped rows is NOT_FOUND at once (a
    later transfer landed), the newest are still there."""
    from services.bridge import push
    monkeypatch.setattr(push, "PARK_MAX_BYTES", 3 * 100 * 8 * 4)               # three [100, 8] fp32 transfers
    sender, receiver = pair("gloo", "gloo")
    assert sender.ready and receiver.ready, (sender.error, receiver.error)
    rows = {tid: torch.full((100, 8), float(tid)) for tid in range(1, 6)}
    for tid, r in rows.items():
        sender.send(tid, r)
    assert torch.equal(receiver.take(5, timeout_s=10), rows[5])                 # all five landed by now
    for tid in (1, 2):
        t0 = time.monotonic()
        with pytest.raises(LookupError, match=f"transfer {tid} is not held by the target"):
            receiver.take(tid, timeout_s=10)
        assert time.monotonic() - t0 < 0.5                                      # known gone: no wait
    for tid in (3, 4):
        assert torch.equal(receiver.take(tid, timeout_s=10), rows[tid])
    sender.send(6, torch.zeros(2000, 8))                                        # one transfer over the cap is kept
    assert receiver.take(6, timeout_s=10).shape == (2000, 8)


def test_a_pushed_transfer_is_taken_once_and_a_later_one_is_waited_for():
    """A take of a transfer already taken is NOT_FOUND; a take of one not sent yet waits for it (the target sends
    the next round's Propose before its rows), and one never sent is NOT_FOUND after RING_WAIT_S."""
    import threading
    from services.bridge.channel import RING_WAIT_S
    sender, receiver = pair("gloo", "gloo")
    assert sender.ready and receiver.ready, (sender.error, receiver.error)
    sender.send(1, torch.ones(3, 8))
    assert torch.equal(receiver.take(1, timeout_s=10), torch.ones(3, 8))
    with pytest.raises(LookupError):
        receiver.take(1, timeout_s=10)
    threading.Timer(0.2, sender.send, (2, torch.full((4, 8), 2.0))).start()
    t0 = time.monotonic()
    assert torch.equal(receiver.take(2, timeout_s=10), torch.full((4, 8), 2.0))
    assert 0.15 < time.monotonic() - t0 < RING_WAIT_S
    t0 = time.monotonic()
    with pytest.raises(LookupError):
        receiver.take(3, timeout_s=10)
    assert time.monotonic() - t0 >= RING_WAIT_S
    rows = torch.randn(5, 8)
    rows[2, 1] = float("nan")
    sender.send(4, rows)
    from services.bridge.rows import ContractError
    with pytest.raises(ContractError, match="pushed holds non-finite values .* in 1 of 5 rows, first at row 2"):
        receiver.take(4, timeout_s=10, field="pushed")
    assert receiver.ready and sender.ready


def test_contradicting_choices_fail_both_sides_naming_both():
    sender, receiver = pair("gloo", "nccl")
    assert not sender.ready and not receiver.ready
    for ch in (sender, receiver):
        assert "different hidden-row transports" in ch.error and "target --hidden-transport gloo" in ch.error \
            and "draft --hidden-transport nccl" in ch.error, ch.error
    with pytest.raises(TimeoutError, match="different hidden-row transports"):
        receiver.take(1, timeout_s=1)


def test_channel_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        RowChannel("127.0.0.1:1", "sender", "inline")


def test_service_config_accepts_ipc_only_on_cuda():
    cfg = ServiceConfig(role="draft", model="m", hidden_transport="auto").validate()
    assert cfg.bridge_backend == "auto"                  # settled with the peer, not from this side alone
    assert ServiceConfig(role="draft", model="m", hidden_transport="inline").bridge_backend is None
    with pytest.raises(SystemExit, match="--hidden-transport ipc needs --device cuda"):
        ServiceConfig(role="draft", model="m", hidden_transport="ipc").validate()


# --- tandem serve: where the draft goes, what it is told ----------------------------------------------
def flags(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("argv, gpus, want", [
    (["--device", "cuda"], 2, ("cuda:0", "cuda:1")),              # unchanged default on two GPUs
    (["--device", "cuda"], 1, ("cuda:0", "cuda:0")),              # one GPU: shared (IPC under auto)
    (["--device", "cuda", "--draft-device", "cuda:0"], 2, ("cuda:0", "cuda:0")),
    (["--device", "cuda", "--draft-device", "cuda"], 2, ("cuda:0", "cuda:0")),
    (["--device", "cuda:1"], 2, ("cuda:1", "cuda:1")),
    (["--device", "cpu"], 0, ("cpu", "cpu")),
])
def test_serve_places_the_draft(monkeypatch, argv, gpus, want):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    a = serve.parse(argv)
    assert serve.placement(a) == want
    cmds = {name: cmd for name, cmd, _ in serve.commands(a)}
    assert (flags(cmds["target"], "--device"), flags(cmds["draft"], "--device")) == want
    # auto stays auto on every side: target and draft settle it from both devices (no inline on one GPU)
    assert {flags(c, "--hidden-transport") for c in cmds.values()} == {"auto"}


def test_serve_passes_ipc_to_the_services_and_checks_the_placement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cmds = {n: c for n, c, _ in serve.commands(serve.parse(["--device", "cuda", "--draft-device", "cuda:0",
                                                            "--hidden-transport", "ipc"]))}
    assert flags(cmds["target"], "--hidden-transport") == flags(cmds["draft"], "--hidden-transport") == "ipc"
    assert flags(cmds["gateway"], "--hidden-transport") == "auto"      # the gateway only asks for the bridge
    with pytest.raises(SystemExit, match=r"ipc hidden transport needs target and draft on the same GPU.*; got target "
                                         "cuda:0, draft cuda:1"):
        serve.commands(serve.parse(["--device", "cuda", "--hidden-transport", "ipc"]))
    with pytest.raises(SystemExit, match=r"nccl hidden transport needs target and draft on two different GPUs.*; got "
                                         "target cuda:0, draft cuda:0"):
        serve.commands(serve.parse(["--device", "cuda", "--draft-device", "cuda:0", "--hidden-transport", "nccl"]))


def test_serve_passes_the_ipc_ring_size_to_the_target(monkeypatch):
    # --bridge-ipc-mib is a target flag; `tandem serve` must hand it on (the draft's receiver end ignores it)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cmds = {n: c for n, c, _ in serve.commands(serve.parse(["--device", "cuda", "--bridge-ipc-mib", "64"]))}
    assert flags(cmds["target"], "--bridge-ipc-mib") == "64"
    assert "--bridge-ipc-mib" not in cmds["draft"] and "--bridge-ipc-mib" not in cmds["gateway"]


def test_rows_finiteness_check_names_the_first_bad_row_and_passes_large_finite_rows():
    from services.bridge.rows import ContractError, check_finite
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(6, 64).to(dtype)
        check_finite(rows, "ok")
        check_finite(rows[:0], "empty")
        for bad in (math.nan, math.inf, -math.inf):
            poisoned = rows.clone()
            poisoned[4, 7] = bad
            poisoned[2, 0] = bad
            want = r"rows holds non-finite values \(NaN or inf\) in 2 of 6 rows, first at row 2"
            with pytest.raises(ContractError, match=want):
                check_finite(poisoned, "rows")
    huge = torch.full((4, 64), 3e38)                 # finite, but their fp32 sum overflows: not refused
    check_finite(huge, "huge")
    huge[3, 1] = -3e38                               # +inf and -inf sums in one tensor: still finite rows
    check_finite(huge, "huge")
