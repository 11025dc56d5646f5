"""The bridge: a two-process channel that moves hidden rows target -> draft.

Rank 0 (target) sends, rank 1 (draft) receives. The transport is agreed at start-up from both sides'
request and device (transport.py): shared host memory (shm.py) between CPU processes of one host, gloo
between other CPU sides, NCCL between two GPUs, CUDA IPC (ipc.py) when both are on one GPU (NCCL
refuses two ranks on one device). The channel has its own TCPStore rendezvous (not the target's TP group), so either side can start first.

NCCL and gloo pull: the target parks each transfer's rows under its id and answers when the draft
asks for that id. No point-to-point operation is ever left posted while its peer is busy: an
outstanding NCCL receive (or send) deadlocks against work that synchronizes the device (a
cudaMalloc, a pageable copy) on that side. A request goes through the store; the target acks it
(so the draft can time out on the CPU without posting anything) and then sends a frame, a header
[transfer_id, rows, bytes per row, dtype] and the payload as bytes, by p2p on the channel's own CUDA
stream. Pulls are serialized, so at most one frame is in flight. Parked rows not pulled within
PARK_TTL_S are dropped, and the oldest go first while more than PARK_MAX_BYTES are parked: the prompt rows
of a request the adaptive policy parks at k = 0 before its first Propose are never pulled, and at long
prompts they would otherwise hold GPU memory for the whole TTL (a late pull of dropped rows is NOT_FOUND,
which the gateway treats as a lost draft state: it re-syncs).

CUDA IPC and shared host memory push: nothing is ever posted, so the target copies each transfer into
its slot of a ring in shared device (ipc.py) or host memory (shm.py, two CPU processes of one host) as it
sends it, and the draft copies it out when it asks, without a round trip (ipc.py has the ordering
invariants). A transfer overwritten before it was taken is reported
gone (LookupError), never returned with another transfer's rows. On a ring the target pushes the next round's
Propose before the rows it names (services/target/server.py), so the draft's take_later waits for a transfer
its slot does not hold yet (up to RING_WAIT_S); on the CUDA IPC ring it reads the rows in place on the caller's
stream (no copy) with the finiteness check queued behind them, and checks both once the Propose's compute is done
(one sync for the whole call), marking the slot read only then.

Handshake and generations (how the two ends find each other, and again after either restarts):
generations.py; link.py holds one generation's transport.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from services.bridge.generations import FOREVER, Generations
from services.bridge.ipc import DEFAULT_CAPACITY, IpcReceiver, IpcSender
from services.bridge.link import Link
from services.bridge.rows import DTYPE_TO_PB, PB_TO_DTYPE, check_finite, finite_flag
from services.bridge.shm import ShmReceiver, ShmSender
from services.bridge.transport import TRANSPORTS

PARK_TTL_S = 120.0
PARK_MAX_BYTES = 1 << 30                          # rows parked at once, at most (the oldest are dropped)
RINGS_SENT = (IpcSender, ShmSender)               # transports that push frames into a ring (no pulls)
RINGS_TAKEN = (IpcReceiver, ShmReceiver)
RING_NAMES = {"ipc": "CUDA IPC", "shm": "shared-memory"}
RING_WAIT_S = 1.0                                 # take_later: a transfer not yet in its ring slot is waited for


class RowChannel(Generations):
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
        super().__init__(host, int(port), role, backend, torch.device(device), timeout_s, hello, ipc_bytes)
        self.peer = 1 - self.rank
        threading.Thread(target=self._run, daemon=True, name=f"bridge-{role}").start()

    # --- sender (target) -----------------------------------------------------------------------
    def fits(self, rows: torch.Tensor) -> bool:
        """Whether the agreed transport can carry rows [N, D] (an IPC slot is bounded; others are not)."""
        ring = self._link.ipc if self._link is not None else None
        return not isinstance(ring, RINGS_SENT) or ring.fits(rows.numel() * rows.element_size())

    @property
    def pushes(self) -> bool:
        """Whether the agreed transport is a ring (the draft's take_later waits for a transfer not yet pushed;
        a pull must find its rows parked already)."""
        return self._link is not None and isinstance(self._link.ipc, RINGS_SENT)

    def send(self, transfer_id: int, rows: torch.Tensor) -> None:
        """Make rows [N, D] of transfer_id available to the draft; returns at once. NCCL / gloo park
        them until pulled; IPC pushes them into their ring slot now (no pull round trip later).
        ValueError when they do not fit the transport (ask `fits` first: the caller sends them inline)."""
        if not self.fits(rows):
            ring = RING_NAMES.get(self.transport, self.transport)
            raise ValueError(f"hidden rows transfer {transfer_id}: {rows.numel() * rows.element_size()} bytes "
                             f"({rows.shape[0]} rows) exceed a {ring} ring slot of {self._link.ipc.slot_bytes} bytes")
        ready = None
        if self._stream is not None and rows.is_cuda:   # the rows are complete once the caller's stream is
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        with self._lock:
            ipc = self._link.ipc if self._link is not None else None
            if isinstance(ipc, RINGS_SENT):
                with _on(self._stream):
                    if ready is not None:
                        self._stream.wait_event(ready)
                    ipc.push(transfer_id, rows.detach().to(self.device), DTYPE_TO_PB[rows.dtype], self._stream)
                return
            now = time.monotonic()
            for tid in [t for t, (at, _, _) in self._parked.items() if now - at > PARK_TTL_S]:
                del self._parked[tid]                # never pulled (its Propose failed or never came)
            self._parked[transfer_id] = (now, rows.detach(), ready)
            held = sum(r.numel() * r.element_size() for _, r, _ in self._parked.values())
            while held > PARK_MAX_BYTES and len(self._parked) > 1:    # oldest first (dicts keep insertion order)
                _, r, _ = self._parked.pop(next(iter(self._parked)))
                held -= r.numel() * r.element_size()

    def _serve_pulls(self):
        """Answer this generation's pulls in order; ends by Superseded (a newer draft joined) or an error
        (the draft is gone)."""
        link = self._link
        while True:
            n = link.pulls
            tid = int(self._wait(f"{link.prefix}pull/{n}", FOREVER))
            with self._lock:
                _, rows, ready = self._parked.pop(tid, (0, None, None))
            self._store.set(f"{link.prefix}ack/{n}", b"1" if rows is not None else b"0")
            if rows is not None:
                with _on(self._stream):
                    if ready is not None:
                        self._stream.wait_event(ready)
                    link.send_frame(tid, rows, self._stream)
            link.pulls += 1

    # --- receiver (draft) ----------------------------------------------------------------------
    def take(self, transfer_id: int, timeout_s: float, field: str | None = None) -> torch.Tensor:
        """The rows of `transfer_id` [N, D] (IPC: from its ring slot; else pulled); LookupError when the
        target no longer holds them, TimeoutError if it does not answer (the draft then joins again). `field`:
        the rows are checked finite (rows.check_finite names it), on the IPC ring before the take's one sync."""
        return self._take(transfer_id, timeout_s, field, later=False)[0]

    def take_later(self, transfer_id: int, timeout_s: float,
                   field: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """take() without waiting for the rows: on a ring a transfer not yet pushed is waited for (up to
        RING_WAIT_S: the target pushes the next round's Propose before the rows it names), and on the CUDA IPC
        ring the rows are the ring slot itself, the caller's stream made to wait for the frame, the finiteness
        check queued on it. -> (rows, landed): on the CUDA IPC ring landed() raises what take() would have
        (LookupError: overwritten before or during the use; ContractError: not finite) and marks the slot read
        (after it, the target may overwrite the rows): call it once the caller's work on the rows is queued (it
        synchronizes that stream); elsewhere the rows were checked already (landed None)."""
        return self._take(transfer_id, timeout_s, field, later=True)

    def _take(self, transfer_id: int, timeout_s: float, field: str | None, later: bool):
        if self.error or not self._ready.wait(timeout_s) or self.error:    # a failed channel answers at once
            raise TimeoutError("hidden rows bridge not connected" + (f": {self.error}" if self.error else ""))
        with self._lock:                              # one pull at a time, in order
            link = self._link
            if link is None:
                raise TimeoutError("hidden rows bridge not connected (joining again)")
            flag, whole = [], None
            ring = link.ipc if isinstance(link.ipc, RINGS_TAKEN) else None
            if isinstance(ring, IpcReceiver) and later:          # read in place on the caller's stream
                use = torch.cuda.current_stream(ring.buf.device)
                got = ring.take_in_place(transfer_id, use, RING_WAIT_S)
                if got is not None:
                    payload, code, whole, release = got
                    got = payload, code
                    if field:                                    # queued on `use` too, read in landed()
                        flag.append(finite_flag(_typed(payload, PB_TO_DTYPE[code])))
            elif isinstance(ring, IpcReceiver):
                check = (lambda out, code: flag.append(finite_flag(_typed(out, PB_TO_DTYPE[code])))) if field \
                    else None
                got = ring.take(transfer_id, self._stream, check)
            elif ring is not None:
                got = ring.take(transfer_id, wait_s=RING_WAIT_S if later else 0.0)
            else:
                n_rows, row_bytes, code, payload = self._pull(link, transfer_id, timeout_s)
        if ring is not None:
            if got is None:
                raise LookupError(_gone(transfer_id, link.transport))
            payload, code = got
            if payload.is_cuda and whole is None:             # a copy made on the channel's stream
                payload.record_stream(torch.cuda.current_stream(payload.device))
            rows = _typed(payload, PB_TO_DTYPE[code])
        else:
            dtype = PB_TO_DTYPE[code]
            rows = payload.view(dtype).reshape(n_rows, row_bytes // dtype.itemsize).to(self.device)

        def landed() -> None:
            try:
                if whole is not None:
                    use.synchronize()                 # done already where the caller synchronized past the use
                    if not whole():
                        raise LookupError(_gone(transfer_id, link.transport))
                if field:
                    check_finite(rows, field, flag[0] if flag else None)
            finally:
                if whole is not None:
                    release()                         # the slot read: after the use, and the full check if it ran
        if whole is None:                             # taken whole (synchronized, or no GPU ring): checked now
            landed()
            return rows, None
        return rows, landed

    def _pull(self, link: Link, transfer_id: int, timeout_s: float):
        """Ask the target for a transfer and receive its frame (under the lock). A pull that fails other
        than by NOT_FOUND breaks the generation: TimeoutError, and the draft joins again."""
        n = link.pulls
        link.pulls += 1
        try:
            self._store.set(f"{link.prefix}pull/{n}", str(transfer_id))
            try:
                self._store.wait([f"{link.prefix}ack/{n}"], timedelta(seconds=timeout_s))
            except Exception:
                raise TimeoutError(f"target did not answer pull {n} within {timeout_s:.1f}s") from None
            if self._store.get(f"{link.prefix}ack/{n}") != b"1":    # the caller answers NOT_FOUND
                raise LookupError(f"hidden rows transfer {transfer_id} is not held by the target "
                                  f"(expired, already taken, or never sent)")
            with _on(self._stream):
                tid, n_rows, row_bytes, code, payload = link.recv_frame()
                if self._stream is not None:
                    self._stream.synchronize()        # rows complete from here
                if payload.is_cuda:                   # made on the channel's stream, used on the caller's
                    payload.record_stream(torch.cuda.current_stream(payload.device))
            if tid != transfer_id:                    # out of step: this generation is done, join again
                raise TimeoutError(f"pulled transfer {transfer_id}, received frame {tid}")
        except LookupError:
            raise
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else str(e)
            self._ready.clear()
            self._broken.set()
            raise TimeoutError(f"hidden rows transfer {transfer_id}: {self.error}") from None
        return n_rows, row_bytes, code, payload

    def discard(self, transfer_id: int) -> None:
        """Receiver side: nothing to free (NCCL / gloo move rows only when pulled; an IPC slot is reused)."""


def _gone(transfer_id: int, transport: str) -> str:
    return (f"hidden rows transfer {transfer_id} is not in its {transport} ring slot (overwritten by a later "
            "transfer, or never sent)")


def _typed(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [N, bytes per row] uint8 -> [N, D] of dtype (a view)
    return payload.view(dtype).reshape(payload.shape[0], payload.shape[1] // dtype.itemsize)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
