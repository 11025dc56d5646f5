"""CUDA IPC for the hidden-row bridge when target and draft share one GPU (NCCL refuses two ranks on
one device): the target pushes each transfer into a ring of slots as it sends it, the draft copies it
out when it asks, with no round trip between them.

Invariants:
* One device buffer of `slots` x `slot_bytes`, allocated by the sender (target) and mapped by the
  receiver (draft) once at start-up; handles cross the bridge's TCPStore once, as JSON (never pickle:
  the store is a network service). Each side holds its tensor / mapping for the channel's life.
* Transfer t lives in slot t % slots. Per slot two interprocess events, each recorded only by the
  process that created it: `written` (sender: the slot holds its frame) and `read` (receiver: copied
  out). The sender's stream waits on `read` before it overwrites a slot; the receiver's stream waits on
  `written` before it copies out.
* Per slot a host header in shared memory [transfer id, rows, bytes per row, dtype code]. The sender
  sets the id to -1 before it queues an overwrite and publishes the new id last, after `written` is
  recorded. The receiver reads the id before its copy and again after the copy completed: the frame
  is used only if both equal the transfer asked for. So a transfer overwritten before or during the
  copy is reported as gone (LookupError upstream), never returned with another transfer's rows.
* A frame never exceeds a slot: `fits` is asked first; rows that do not fit go inline.
"""
from __future__ import annotations

import atexit
import json
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from services.bridge.segments import segment_name, sweep_orphans

DEFAULT_CAPACITY = 256 << 20      # bytes over all slots
DEFAULT_SLOTS = 8                 # transfers that may be outstanding at once (a round has 1-3)
_EMPTY = -1


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (the same GPU has the same UUID in every process, whatever its index there)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class SlotHeaders:
    """[slots, 4] int64 in shared memory: transfer id (-1: none), rows, bytes per row, dtype code."""

    def __init__(self, slots: int, name: str | None = None):
        size = slots * 4 * 8
        if name is None:
            sweep_orphans("ipc")
            self.shm = shared_memory.SharedMemory(name=segment_name("ipc"), create=True, size=size)
            self.owner = True
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(self.shm._name, "shared_memory")   # the owner unlinks it, not us
            self.owner = False
        self.table = np.ndarray((slots, 4), dtype=np.int64, buffer=self.shm.buf)
        if self.owner:
            self.table[:, 0] = _EMPTY

    @property
    def name(self) -> str:
        return self.shm.name

    def invalidate(self, slot: int) -> None:
        self.table[slot, 0] = _EMPTY

    def publish(self, slot: int, tid: int, n_rows: int, row_bytes: int, code: int) -> None:
        self.table[slot, 1:] = (n_rows, row_bytes, code)
        self.table[slot, 0] = tid                     # last: the frame is whole once its id shows

    def read(self, slot: int) -> tuple[int, int, int, int]:
        tid, n_rows, row_bytes, code = (int(x) for x in self.table[slot])
        return tid, n_rows, row_bytes, code

    def tid(self, slot: int) -> int:
        return int(self.table[slot, 0])

    def wait(self, slot: int, tid: int, wait_s: float) -> tuple[int, int, int] | None:
        """Transfer tid's header -> (rows, bytes per row, dtype code); None when the slot holds a later transfer
        (tid is gone), or still an earlier one (or a frame being written) after wait_s: a Propose the target
        pushes a round ahead reaches the draft before the rows it names (services/bridge/channel.py)."""
        t0 = time.perf_counter()
        while True:
            seen, n_rows, row_bytes, code = self.read(slot)
            if seen == tid:
                return n_rows, row_bytes, code
            waited = time.perf_counter() - t0
            if seen > tid or waited >= wait_s:
                return None
            # the target publishes ~0.1-0.3 ms after its Propose: spin that long, then poll without holding a core
            time.sleep(0 if waited < 0.002 else 0.0005)

    def close(self) -> None:
        if self.table is None:
            return
        self.table = None
        self.shm.close()
        if self.owner:                                # the segment outlives an attached reader, not its owner
            self.shm.unlink()


class IpcSender:
    """The sender's end: owns the buffer, the headers and the `written` events. Build, publish
    `spec()`, then `attach()` the receiver's answer."""

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY, slots: int = DEFAULT_SLOTS):
        if capacity < slots or slots < 1:
            raise ValueError(f"CUDA IPC ring: {slots} slots in {capacity} bytes")
        self.device, self.slots, self.slot_bytes = device, slots, capacity // slots
        self.buf = torch.empty(slots * self.slot_bytes, dtype=torch.uint8, device=device)   # [slots * slot_bytes]
        self.written = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        self.read: list[torch.cuda.Event] = []
        self.headers = SlotHeaders(slots)
        atexit.register(self.headers.close)

    def spec(self) -> str:
        """What the receiver needs: handles, not data (torch's own CUDA IPC sharing tuple)."""
        _, handle, size, offset, ref, ref_offset, event, event_sync = self.buf.untyped_storage()._share_cuda_()
        return json.dumps({"slots": self.slots, "slot_bytes": self.slot_bytes, "handle": _hex(handle),
                           "size": size, "offset": offset, "ref_counter": _hex(ref),
                           "ref_counter_offset": ref_offset, "event": _hex(event), "event_sync": bool(event_sync),
                           "written": [_hex(e.ipc_handle()) for e in self.written], "headers": self.headers.name})

    def attach(self, answer: bytes) -> None:
        """The receiver's answer: its `read` events, or the error it hit mapping the buffer."""
        peer = json.loads(answer)
        if "error" in peer:
            raise RuntimeError(f"the draft could not map the CUDA IPC buffer: {peer['error']}")
        dev = torch.device("cuda", _index(self.device))
        self.read = [torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(h)) for h in peer["read"]]

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def push(self, tid: int, rows: torch.Tensor, code: int, stream: torch.cuda.Stream) -> None:
        """Queue rows [N, D] into slot tid % slots on `stream` (the caller made it wait for the rows'
        producer) and publish its header."""
        row_bytes = rows.shape[1] * rows.element_size()
        flat = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)   # [N, row bytes]
        n = flat.numel()
        if not self.fits(n):
            raise ValueError(f"hidden rows of {n} bytes ({rows.shape[0]} rows) do not fit a CUDA IPC slot "
                             f"of {self.slot_bytes} bytes")
        slot = tid % self.slots
        self.headers.invalidate(slot)                 # before the overwrite is queued
        stream.wait_event(self.read[slot])            # the receiver copied the slot's last frame out
        with torch.cuda.stream(stream):
            if n:
                start = slot * self.slot_bytes
                self.buf[start:start + n].view_as(flat).copy_(flat)
            self.written[slot].record(stream)
        rows.record_stream(stream)                    # the caller may drop rows before this copy ran
        self.headers.publish(slot, tid, flat.shape[0], row_bytes, code)

    def close(self) -> None:
        self.headers.close()


class IpcReceiver:
    """The receiver's end: maps the sender's buffer and headers, opens `written`, owns `read`."""

    def __init__(self, device: torch.device, spec: bytes):
        peer = json.loads(spec)
        if "error" in peer:
            raise RuntimeError(f"the target could not share its CUDA IPC buffer: {peer['error']}")
        self.device, self.slots, self.slot_bytes = device, int(peer["slots"]), int(peer["slot_bytes"])
        total = self.slots * self.slot_bytes
        if int(peer["size"]) < total:
            raise RuntimeError(f"CUDA IPC storage holds {peer['size']} bytes, the sender says {total}")
        index = _index(device)                        # this process's index of the GPU (the sender's may differ)
        storage = torch.UntypedStorage._new_shared_cuda(
            index, bytes.fromhex(peer["handle"]), int(peer["size"]), int(peer["offset"]),
            bytes.fromhex(peer["ref_counter"]), int(peer["ref_counter_offset"]),
            _unhex(peer["event"]), bool(peer["event_sync"]))
        # [slots * slot_bytes], mapped; held (with the mapping) for the channel's life
        self.buf = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage, 0, (total,), (1,))
        dev = torch.device("cuda", index)
        self.written = [torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(h)) for h in peer["written"]]
        self.read = [torch.cuda.Event(interprocess=True) for _ in range(self.slots)]
        self.headers = SlotHeaders(self.slots, peer["headers"])

    def answer(self) -> str:
        return json.dumps({"read": [_hex(e.ipc_handle()) for e in self.read]})

    def take(self, tid: int, stream: torch.cuda.Stream, then=None, wait_s: float = 0.0):
        """-> (rows [N, bytes per row] uint8, dtype code), or None when transfer `tid` is not (or no
        longer) in its slot (not yet there: waited for up to wait_s). Synchronizes `stream`: the rows are
        complete when returned; then(rows, code), if given, enqueues more work on the stream before that one
        sync."""
        got = self.take_in_place(tid, stream, wait_s)
        if got is None:
            return None
        rows, code, whole, release = got
        with torch.cuda.stream(stream):
            out = rows.clone()
            release()
            if then is not None:
                then(out, code)
        stream.synchronize()
        return (out, code) if whole() else None              # overwritten meanwhile: gone

    def take_in_place(self, tid: int, stream: torch.cuda.Stream, wait_s: float = 0.0):
        """take() without a copy or a wait, for a caller that uses the rows on `stream` (the draft's compute):
        -> (the slot's rows [N, bytes per row] uint8 as they sit in the ring, dtype code, whole, release), or None
        as take(). `stream` waits for the frame; release() marks the slot read on `stream` after the caller's use
        (the target overwrites it only after that, or after an earlier mark: then its header no longer shows tid);
        whole(), once the stream's work is done: the slot still held the transfer through the use."""
        slot = tid % self.slots
        header = self.headers.wait(slot, tid, wait_s)
        if header is None:
            return None
        n_rows, row_bytes, code = header
        stream.wait_event(self.written[slot])
        start = slot * self.slot_bytes
        rows = self.buf[start:start + n_rows * row_bytes].view(n_rows, row_bytes)
        return rows, code, lambda: self.headers.tid(slot) == tid, lambda: self.read[slot].record(stream)

    def close(self) -> None:
        self.headers.close()


def error_answer(e: Exception) -> str:
    return json.dumps({"error": f"{type(e).__name__}: {e}"})


def _hex(b: bytes | None) -> str | None:
    return None if b is None else b.hex()


def _unhex(s: str | None) -> bytes | None:
    return None if s is None else bytes.fromhex(s)
