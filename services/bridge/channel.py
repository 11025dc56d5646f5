"""The bridge: a two-process channel that moves hidden rows target -> draft.

Rank 0 (target) sends, rank 1 (draft) receives. The transport is agreed at start-up from both sides'
request and device (transport.py): shared host memory (shm.py) between CPU processes of one host, gloo
between other CPU sides, NCCL between two GPUs, CUDA IPC (ipc.py) when both are on one GPU (NCCL
refuses two ranks on one device). The channel has its own TCPStore rendezvous (not the target's TP group), so either side can start first.

Every transport pushes: the target makes each transfer available as it answers, without waiting for the draft
to ask, and the target sends the next round's Propose before the rows it names (services/target/server.py), so
the draft's take waits for a transfer not there yet (up to RING_WAIT_S; timeout_s once an NCCL / gloo header
announced it).
* CUDA IPC and shared host memory: the target copies each transfer into its slot of a ring in shared device
  (ipc.py) or host memory (shm.py, two CPU processes of one host), the draft copies it out (ipc.py has the
  ordering invariants). A transfer overwritten before it was taken is reported gone (LookupError), never
  returned with another transfer's rows. On the CUDA IPC ring the draft reads the rows in place on the caller's
  stream (no copy) with the finiteness check queued behind them, and checks both once the Propose's compute is
  done (one sync for the whole call), marking the slot read only then.
* NCCL and gloo (push.py): the header through the store, the payload by p2p on the channel's own CUDA stream;
  the draft's drain thread receives every frame once its header is there, so no receive is ever left posted
  before its send (an outstanding NCCL receive deadlocks against work that synchronizes the device on that
  side). Frames not pushed yet, and frames landed but never taken (the prompt rows of a request the adaptive
  policy keeps at k = 0), are bounded by PARK_TTL_S and PARK_MAX_BYTES; a take of dropped rows is NOT_FOUND,
  which the gateway treats as a lost draft state: it re-syncs.

Handshake and generations (how the two ends find each other, and again after either restarts):
generations.py; link.py holds one generation's transport.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from services.bridge.generations import JOIN_POLL_S, Generations, Superseded
from services.bridge.ipc import DEFAULT_CAPACITY, IpcReceiver, IpcSender
from services.bridge.push import on_stream, push_frame
from services.bridge.rows import DTYPE_TO_PB, PB_TO_DTYPE, check_finite, finite_flag
from services.bridge.shm import ShmReceiver, ShmSender
from services.bridge.transport import TRANSPORTS

RINGS_SENT = (IpcSender, ShmSender)               # transports that push frames into a ring slot
RINGS_TAKEN = (IpcReceiver, ShmReceiver)
RING_NAMES = {"ipc": "CUDA IPC", "shm": "shared-memory"}
RING_WAIT_S = 1.0                                 # a take: a transfer not yet pushed (or landed) is waited for


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
    def ring(self) -> bool:
        """Whether the agreed transport is a ring (CUDA IPC, shared memory): a send is a copy into a slot, queued
        on the stream; the target pushes a Verify's rows before its acceptance only there (server.py)."""
        return self._link is not None and isinstance(self._link.ipc, RINGS_SENT)

    @property
    def pushes(self) -> bool:
        """Whether a transport is connected: every one pushes, so the target may send the next round's Propose
        before the rows it names (the draft's take waits for them)."""
        return self._link is not None

    def send(self, transfer_id: int, rows: torch.Tensor) -> None:
        """Make rows [N, D] of transfer_id available to the draft; returns at once. The rings copy them into
        their slot now; NCCL / gloo queue them for the push thread (push.py). ValueError when they do not fit
        the transport (ask `fits` first: the caller sends them inline)."""
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
                with on_stream(self._stream):
                    if ready is not None:
                        self._stream.wait_event(ready)
                    ipc.push(transfer_id, rows.detach().to(self.device), DTYPE_TO_PB[rows.dtype], self._stream)
                return
        self._frames.put(transfer_id, rows.detach(), ready)

    def _serve_pushes(self):
        """Push this generation's frames in order as they are sent; ends by Superseded (a newer draft joined) or
        an error (the draft is gone, or did not receive a frame within push.PUSH_TIMEOUT_S)."""
        link = self._link
        while True:
            if self._latest > link.generation:
                raise Superseded
            got = self._frames.pop_first(JOIN_POLL_S)
            if got is not None:
                push_frame(link, self._store, *got, self._stream)

    # --- receiver (draft) ----------------------------------------------------------------------
    def take(self, transfer_id: int, timeout_s: float, field: str | None = None) -> torch.Tensor:
        """The rows of `transfer_id` [N, D] (from its ring slot, or landed by the drain thread: waited for up to
        RING_WAIT_S, or timeout_s once its header came); LookupError when they are not coming (dropped, or sent
        to an earlier generation), TimeoutError when the bridge is down or broke (the draft then joins again). `field`:
        the rows are checked finite (rows.check_finite names it), on the IPC ring before the take's one sync."""
        return self._take(transfer_id, timeout_s, field, later=False)[0]

    def take_later(self, transfer_id: int, timeout_s: float,
                   field: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """take() without waiting for the rows to be copied: on the CUDA IPC
        ring the rows are the ring slot itself, the caller's stream made to wait for the frame, the finiteness
        check queued on it. -> (rows, landed): on the CUDA IPC ring landed() raises what take() would have
        (LookupError: overwritten before or during the use; ContractError: not finite) and marks the slot read
        (after it, the target may overwrite the rows): call it once the caller's work on the rows is queued (it
        synchronizes that stream); elsewhere the rows were checked already (landed None)."""
        return self._take(transfer_id, timeout_s, field, later=True)

    def _take(self, transfer_id: int, timeout_s: float, field: str | None, later: bool):
        if self.error or not self._ready.wait(timeout_s) or self.error:    # a failed channel answers at once
            raise TimeoutError("hidden rows bridge not connected" + (f": {self.error}" if self.error else ""))
        with self._lock:                              # one take at a time
            link = self._link
            if link is None:
                raise TimeoutError("hidden rows bridge not connected (joining again)")
            flag, whole, got = [], None, None
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
        if ring is not None:
            if got is None:
                raise LookupError(_gone(transfer_id, link.transport))
            payload, code = got
            if payload.is_cuda and whole is None:             # a copy made on the channel's stream
                payload.record_stream(torch.cuda.current_stream(payload.device))
            rows = _typed(payload, PB_TO_DTYPE[code])
        else:
            rows = self._landed(transfer_id, timeout_s, flag)

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

    def _landed(self, transfer_id: int, timeout_s: float, flag: list) -> torch.Tensor:
        """NCCL / gloo: the rows the drain thread received (push.py), with whether they are finite in `flag`. A
        transfer announced and not received within timeout_s breaks the generation (the draft joins again)."""
        try:
            got = self._frames.take(transfer_id, RING_WAIT_S, timeout_s)
        except TimeoutError as e:
            if not self._frames.broken:
                self._drain_failed(e)
            raise TimeoutError(f"hidden rows transfer {transfer_id}: {e}") from None
        if got is None:
            raise LookupError(f"hidden rows transfer {transfer_id} is not held by the target (expired, already "
                              "taken, or never sent)")
        rows, finite = got
        if rows.is_cuda:                              # received on the channel's stream, used on the caller's
            rows.record_stream(torch.cuda.current_stream(rows.device))
        flag.append(finite)
        return rows

    def discard(self, transfer_id: int) -> None:
        """Receiver side, after a refused Propose: nothing to free. Landed rows stay until taken or dropped
        (push.PARK_TTL_S, PARK_MAX_BYTES), so a corrected Propose can still take them; a ring slot is reused."""


def _gone(transfer_id: int, transport: str) -> str:
    return (f"hidden rows transfer {transfer_id} is not in its {transport} ring slot (overwritten by a later "
            "transfer, or never sent)")


def _typed(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [N, bytes per row] uint8 -> [N, D] of dtype (a view)
    return payload.view(dtype).reshape(payload.shape[0], payload.shape[1] // dtype.itemsize)

