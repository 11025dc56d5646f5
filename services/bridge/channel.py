"""The bridge: a two-process channel that moves hidden rows target -> draft.

Rank 0 (target) sends, rank 1 (draft) receives. The transport is agreed at start-up from both sides'
request and device (transport.py): gloo on CPU, NCCL between two GPUs, CUDA IPC (ipc.py) when
both are on one GPU (NCCL refuses two ranks on one device). The channel has its own TCPStore
rendezvous (not the target's TP group), so either side can start first.

NCCL and gloo pull: the target parks each transfer's rows under its id and answers when the draft
asks for that id. No point-to-point operation is ever left posted while its peer is busy: an
outstanding NCCL receive (or send) deadlocks against work that synchronizes the device (a
cudaMalloc, a pageable copy) on that side. A request goes through the store; the target acks it
(so the draft can time out on the CPU without posting anything) and then sends a frame, a header
[transfer_id, rows, bytes per row, dtype] and the payload as bytes, by p2p on the channel's own CUDA
stream. Pulls are serialized, so at most one frame is in flight. Parked rows not pulled within
PARK_TTL_S are dropped.

CUDA IPC pushes: nothing is ever posted, so the target copies each transfer into its slot of a ring
in shared device memory as it sends it, and the draft copies it out when it asks, without a round
trip (ipc.py has the ordering invariants). A transfer overwritten before it was taken is reported
gone (LookupError), never returned with another transfer's rows.

Handshake: before any transport exists, each side publishes its `hello` (model identity and
contract version) in the store and reads its peer's; a mismatch ends the channel on both sides with
an error naming both values, so rows never move between different models. Then each publishes its
endpoint (requested transport, device, GPU UUID, process) under its own keys (devices differ
legitimately, so they are not part of `hello`); both sides compute the transport from the same two
records, so they agree, or both fail naming both.
The store's server listens on the bridge address's host only (loopback by default), never on all
interfaces: TCPStore binds every interface unless handed a socket (services/rendezvous.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from services.bridge.ipc import DEFAULT_CAPACITY, IpcReceiver, IpcSender, error_answer
from services.bridge.rows import DTYPE_TO_PB, PB_TO_DTYPE
from services.bridge.transport import TRANSPORTS, choose_transport, endpoint
from services.rendezvous import tcp_store

log = logging.getLogger("tandem.bridge")
PARK_TTL_S = 120.0


class HandshakeError(RuntimeError):
    """Target and draft are not the same model (or not the same contract)."""


class RowChannel:
    def __init__(self, address: str, role: str, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 600.0, hello: dict | None = None, ipc_bytes: int = DEFAULT_CAPACITY):
        """backend: what this side asks for (auto | gloo | nccl | ipc); `transport` is what both agreed.
        ipc_bytes: the sender's CUDA IPC ring over all its slots (a slot is the largest transfer IPC
        carries; the receiver's value is unused)."""
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be sender or receiver, got {role!r}")
        if backend not in TRANSPORTS:
            raise ValueError(f"backend must be one of {list(TRANSPORTS)}, got {backend!r}")
        host, port = address.rsplit(":", 1)
        self.role, self.backend, self.device = role, backend, torch.device(device)
        self.rank, self.peer = (0, 1) if role == "sender" else (1, 0)
        self._peer_role = "receiver" if role == "sender" else "sender"
        self._timeout = timedelta(seconds=timeout_s)
        self._store = tcp_store(host, int(port), 2, role == "sender", self._timeout)
        self.hello = dict(hello or {})                # what the peer must match: model_identity, contract_version
        self._prefix = "tandem-bridge/0/"
        self._ipc_bytes = ipc_bytes
        self.transport: str | None = None             # gloo | nccl | ipc, once agreed
        self._wire = self.device                      # where frames travel: the CPU for gloo
        self._pg = None
        self._ipc: IpcSender | IpcReceiver | None = None
        self._ready = threading.Event()
        self._parked: dict[int, tuple[float, torch.Tensor, object]] = {}
        self._lock = threading.Condition()
        self._pulls = 0                              # receiver: pull requests made so far
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.error: str | None = None
        threading.Thread(target=self._run, daemon=True, name=f"bridge-{role}").start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def _run(self):
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)   # the current device is per thread
            self._handshake()
            self.transport = self._agree()
            if self.transport == "ipc":
                self._ipc = self._open_ipc()
            else:
                self._wire = torch.device("cpu") if self.transport == "gloo" else self.device
                store = dist.PrefixStore(self._prefix + "pg", self._store)
                if self.transport == "nccl":
                    self._pg = dist.ProcessGroupNCCL(store, self.rank, 2)
                else:
                    self._pg = dist.ProcessGroupGloo(store, self.rank, 2, self._timeout)
            self._ready.set()
            log.info("bridge %s connected (%s, %s)", self.role, self.transport, self.device)
            if self.role == "sender":
                self._serve_pulls()
        except Exception as e:  # the channel is gone; the target falls back to inline rows
            self.error = f"{type(e).__name__}: {e}"
            log.error("bridge %s failed: %s", self.role, self.error)

    def _exchange(self, name: str, value: str | bytes) -> bytes:
        """Publish this side's `name`, wait for the peer's and return it."""
        self._store.set(f"{self._prefix}{name}/{self.role}", value)
        key = f"{self._prefix}{name}/{self._peer_role}"
        self._store.wait([key], self._timeout)
        return self._store.get(key)

    def _handshake(self) -> None:
        """Publish hello, wait for the peer's; HandshakeError naming both sides' values on a mismatch."""
        peer = json.loads(self._exchange("hello", json.dumps(self.hello)))
        target, draft = (self.hello, peer) if self.role == "sender" else (peer, self.hello)
        bad = [f"{k}: target {target.get(k)!r}, draft {draft.get(k)!r}"
               for k in sorted(set(target) | set(draft)) if target.get(k) != draft.get(k)]
        if bad:
            raise HandshakeError("target and draft are not the same model; refusing to pair on the hidden-rows "
                                 "bridge (" + "; ".join(bad) + ")")

    def _agree(self) -> str:
        """Both sides compute the transport from the same two endpoint records."""
        mine = endpoint(self.backend, self.device)
        peer = json.loads(self._exchange("endpoint", json.dumps(mine)))
        return choose_transport(*((mine, peer) if self.role == "sender" else (peer, mine)))

    def _open_ipc(self) -> IpcSender | IpcReceiver:
        """Sender: allocate the slot, publish it, attach the receiver's answer; receiver: map it and
        answer. A side that fails publishes its error instead, so the other fails at once naming it."""
        sender = self.role == "sender"
        mine, theirs = f"{self._prefix}ipc/{self.role}", f"{self._prefix}ipc/{self._peer_role}"
        if not sender:
            self._store.wait([theirs], self._timeout)
        try:
            slot = (IpcSender(self.device, self._ipc_bytes) if sender
                    else IpcReceiver(self.device, self._store.get(theirs)))
            self._store.set(mine, slot.spec() if sender else slot.answer())
        except Exception as e:
            self._store.set(mine, error_answer(e))
            raise
        if sender:
            self._store.wait([theirs], self._timeout)
            slot.attach(self._store.get(theirs))
        return slot

    # --- sender (target) -----------------------------------------------------------------------
    def fits(self, rows: torch.Tensor) -> bool:
        """Whether the agreed transport can carry rows [N, D] (an IPC slot is bounded; others are not)."""
        return not isinstance(self._ipc, IpcSender) or self._ipc.fits(rows.numel() * rows.element_size())

    def send(self, transfer_id: int, rows: torch.Tensor) -> None:
        """Make rows [N, D] of transfer_id available to the draft; returns at once. NCCL / gloo park
        them until pulled; IPC pushes them into their ring slot now (no pull round trip later).
        ValueError when they do not fit the transport (ask `fits` first: the caller sends them inline)."""
        if not self.fits(rows):
            raise ValueError(f"hidden rows transfer {transfer_id}: {rows.numel() * rows.element_size()} bytes "
                             f"({rows.shape[0]} rows) exceed a CUDA IPC slot of {self._ipc.slot_bytes} bytes")
        ready = None
        if self._stream is not None and rows.is_cuda:   # the rows are complete once the caller's stream is
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        if isinstance(self._ipc, IpcSender):
            with self._lock, _on(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                self._ipc.push(transfer_id, rows.detach().to(self.device), DTYPE_TO_PB[rows.dtype], self._stream)
            return
        with self._lock:
            now = time.monotonic()
            for tid in [t for t, (at, _, _) in self._parked.items() if now - at > PARK_TTL_S]:
                del self._parked[tid]                # never pulled (its Propose failed or never came)
            self._parked[transfer_id] = (now, rows.detach(), ready)

    def _serve_pulls(self):
        n = 0
        while True:
            key = f"{self._prefix}pull/{n}"
            self._store.wait([key], timedelta(days=365))
            tid = int(self._store.get(key))
            with self._lock:
                _, rows, ready = self._parked.pop(tid, (0, None, None))
            self._store.set(f"{self._prefix}ack/{n}", b"1" if rows is not None else b"0")
            if rows is not None:
                with _on(self._stream):
                    if ready is not None:
                        self._stream.wait_event(ready)
                    self._send_frame(n, tid, rows)
            n += 1

    def _send_frame(self, n: int, tid: int, rows: torch.Tensor) -> None:
        code = DTYPE_TO_PB[rows.dtype]
        row_bytes = rows.shape[1] * rows.element_size()
        payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes).to(self._wire)
        header = torch.tensor([tid, payload.shape[0], row_bytes, code], dtype=torch.int64, device=self._wire)
        self._pg.send([header], self.peer, 0).wait()
        if payload.numel():
            self._pg.send([payload], self.peer, 1).wait()
        if self._stream is not None:
            self._stream.synchronize()

    # --- receiver (draft) ----------------------------------------------------------------------
    def take(self, transfer_id: int, timeout_s: float) -> torch.Tensor:
        """The rows of `transfer_id` [N, D] (IPC: from its ring slot; else pulled); LookupError when the
        target no longer holds them, TimeoutError if it does not answer."""
        if self.error or not self._ready.wait(timeout_s) or self.error:    # a failed channel answers at once
            raise TimeoutError("hidden rows bridge not connected" + (f": {self.error}" if self.error else ""))
        if isinstance(self._ipc, IpcReceiver):
            with self._lock:
                got = self._ipc.take(transfer_id, self._stream)
            if got is None:
                raise LookupError(f"hidden rows transfer {transfer_id} is not in its CUDA IPC slot "
                                  f"(overwritten by a later transfer, or never sent)")
            payload, code = got
            payload.record_stream(torch.cuda.current_stream(payload.device))
            dtype = PB_TO_DTYPE[code]
            return payload.view(dtype).reshape(payload.shape[0], payload.shape[1] // dtype.itemsize)
        with self._lock:                              # one pull at a time, in order
            n = self._pulls
            self._pulls += 1
            self._store.set(f"{self._prefix}pull/{n}", str(transfer_id))
            ack = self._wait(f"{self._prefix}ack/{n}", timeout_s, f"target did not answer pull {n}", transfer_id)
            if ack != b"1":                           # a LookupError: the caller answers NOT_FOUND
                raise LookupError(f"hidden rows transfer {transfer_id} is not held by the target "
                                  f"(expired, already taken, or never sent)")
            with _on(self._stream):
                tid, n_rows, row_bytes, code, payload = self._recv_frame()
                if self._stream is not None:
                    self._stream.synchronize()        # rows complete from here
                if payload.is_cuda:                   # made on the channel's stream, used on the caller's
                    payload.record_stream(torch.cuda.current_stream(payload.device))
            if tid != transfer_id:                    # the channel is out of step: never use it again
                self.error = f"pulled transfer {transfer_id}, received frame {tid}"
                raise TimeoutError(f"hidden rows bridge: {self.error}")
        dtype = PB_TO_DTYPE[code]
        return payload.view(dtype).reshape(n_rows, row_bytes // dtype.itemsize).to(self.device)

    def _wait(self, key: str, timeout_s: float, what: str, transfer_id: int) -> bytes:
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except Exception:
            self.error = f"{what} within {timeout_s:.1f}s"
            raise TimeoutError(f"hidden rows transfer {transfer_id}: {self.error}") from None
        return self._store.get(key)

    def _recv_frame(self):
        """-> (transfer id, rows, bytes per row, dtype code, payload [rows, bytes per row] uint8)."""
        header = torch.empty(4, dtype=torch.int64, device=self._wire)
        self._pg.recv([header], self.peer, 0).wait()
        tid, n_rows, row_bytes, code = header.tolist()
        payload = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device=self._wire)
        if payload.numel():
            self._pg.recv([payload], self.peer, 1).wait()
        return tid, n_rows, row_bytes, code, payload

    def discard(self, transfer_id: int) -> None:
        """Receiver side: nothing to free (NCCL / gloo move rows only when pulled; an IPC slot is reused)."""


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
