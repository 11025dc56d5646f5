"""The hidden-row contract over a running bridge, as the CPU (gloo) and GPU (NCCL, CUDA IPC) tests check
it against raw target and draft stubs. A helper, not a test file."""
from __future__ import annotations

import socket
import time

import grpc
import pytest

from tandem.v1 import common_pb2, draft_pb2, rows_pb2, target_pb2


def bridge_prefill(target, rid: str, prompt: list[int], timeout_s: float = 120.0):
    """Prefill asking for BRIDGE rows, until the bridge (connecting in the background) carries them."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id=rid, prompt_token_ids=prompt)], return_hidden_rows=True,
            transport=rows_pb2.TRANSPORT_BRIDGE), timeout=60)
        if resp.hidden_rows.transport == rows_pb2.TRANSPORT_BRIDGE or time.monotonic() > deadline:
            return resp
        target.Release(common_pb2.ReleaseRequest(request_ids=[rid]), timeout=10)
        time.sleep(0.2)               # polling a background connect; nothing to await on the wire


def assert_bridge_contract(target, draft, rid: str, prompt: list[int]):
    """Prefill `prompt` with its rows on the bridge; a Propose whose descriptor says one row fewer than
    the draft expects must be INVALID_ARGUMENT naming the request and both counts (checked before the
    rows are taken). -> (the rows' descriptor, the ProposeItem a correct Propose sends with it)."""
    resp = bridge_prefill(target, rid, prompt)
    rows = resp.hidden_rows
    assert rows.transport == rows_pb2.TRANSPORT_BRIDGE and rows.num_rows == len(prompt), rows
    item = draft_pb2.ProposeItem(request_id=rid, new_token_ids=prompt + [resp.first_token_ids[0]],
                                 num_draft_tokens=2, position=0)
    bad = draft_pb2.ProposeRequest(items=[item], hidden_rows=[rows])
    bad.hidden_rows[0].rows_per_request[0] = len(prompt) - 1
    bad.hidden_rows[0].num_rows = len(prompt) - 1
    try:
        draft.Propose(bad, timeout=30)
    except grpc.RpcError as e:
        details = e.details()
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), details)
        assert repr(rid) in details and str(len(prompt)) in details and str(len(prompt) - 1) in details, details
    else:
        raise AssertionError(f"request {rid!r}: a Propose with {len(prompt) - 1} rows for {len(prompt)} was accepted")
    return rows, item


OPEN: list = []          # the channels channel_pair() made, closed after each test (close_channels)


def channel_pair(sender_hello: dict, receiver_hello: dict, sender_backend: str = "auto",
                 receiver_backend: str = "auto", timeout_s: float = 30.0):
    """A target (sender) and a draft (receiver) RowChannel in this process on a free port, once both
    connected or both failed. A test file that uses it imports `close_channels` too (autouse)."""
    from services.bridge.channel import RowChannel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    sender = RowChannel(addr, "sender", sender_backend, hello=sender_hello, timeout_s=timeout_s)
    receiver = RowChannel(addr, "receiver", receiver_backend, hello=receiver_hello, timeout_s=timeout_s)
    OPEN.extend([sender, receiver])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ((sender.ready and receiver.ready) or (sender.error and receiver.error)):
        time.sleep(0.05)          # polling the channels' background connect
    return sender, receiver


@pytest.fixture(autouse=True)
def close_channels():
    """After each test: its channels' background threads stop (none is left to wake during interpreter exit)."""
    yield
    while OPEN:
        OPEN.pop().close()
