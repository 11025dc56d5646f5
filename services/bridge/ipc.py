"""CUDA IPC for the hidden-row bridge when target and draft share one GPU (NCCL refuses two ranks on
one device). The channel (channel.py) keeps its pull protocol; only the frame moves differently.

Invariants:
* One slot: a device buffer of `capacity` bytes, allocated by the sender (target) and mapped by the
  receiver (draft) once at start-up; its handle and the events' handles cross the bridge's TCPStore
  once, as JSON. The sender holds its tensor for the channel's life, so the receiver's mapping never
  outlives the allocation; the receiver holds its mapping for the channel's life.
* Two interprocess events; each is recorded only by the process that created it and waited on only by
  the other: `written` (sender: frame n is in the slot) and `read` (receiver: frame n is copied out).
* The slot holds at most one frame. The sender's stream waits for `read` before it overwrites the
  slot, and the receiver's stream waits for `written` before it copies out. The CPU order that makes
  each wait see the record it needs comes from the pull protocol: the sender records `written` before
  it publishes frame n's header, and the receiver records `read` (and synchronizes) before it asks for
  pull n + 1.
* A frame never exceeds the slot: `fits` is asked before rows are parked for the bridge; rows that do
  not fit go inline (the caller's choice), never partly through the slot.
"""
from __future__ import annotations

import json

import torch

DEFAULT_CAPACITY = 64 << 20       # bytes: 4681 rows of a 7168-wide bf16 hidden state


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (the same GPU has the same UUID in every process, whatever its index there)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class IpcSender:
    """The sender's end: owns the slot and the `written` event. Build, publish `spec()`, then
    `attach()` the receiver's answer."""

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY):
        if capacity <= 0:
            raise ValueError(f"IPC slot capacity must be > 0 bytes, got {capacity}")
        self.device, self.capacity = device, capacity
        self.buf = torch.empty(capacity, dtype=torch.uint8, device=device)      # [capacity] bytes
        self.written = torch.cuda.Event(interprocess=True)                      # no timing, non-blocking
        self.read: torch.cuda.Event | None = None

    def spec(self) -> str:
        """What the receiver needs to map the slot and open `written`: handles, not data, as JSON (never
        pickle: the store is a network service). The fields are torch's own CUDA IPC sharing tuple."""
        _, handle, size, offset, ref, ref_offset, event, event_sync = self.buf.untyped_storage()._share_cuda_()
        return json.dumps({"capacity": self.capacity, "handle": _hex(handle), "size": size, "offset": offset,
                           "ref_counter": _hex(ref), "ref_counter_offset": ref_offset, "event": _hex(event),
                           "event_sync": bool(event_sync), "written": _hex(self.written.ipc_handle())})

    def attach(self, answer: bytes) -> None:
        """The receiver's answer: its `read` event, or the error it hit mapping the slot."""
        peer = json.loads(answer)
        if "error" in peer:
            raise RuntimeError(f"the draft could not map the CUDA IPC slot: {peer['error']}")
        self.read = torch.cuda.Event.from_ipc_handle(torch.device("cuda", _index(self.device)),
                                                     bytes.fromhex(peer["read"]))

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def write(self, rows: torch.Tensor, stream: torch.cuda.Stream) -> tuple[int, int]:
        """Queue rows [N, D] into the slot on `stream` (the caller made it wait for the rows' producer);
        -> (N, bytes per row). Records `written` after the copy."""
        row_bytes = rows.shape[1] * rows.element_size()
        flat = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)   # [N, row bytes]
        n = flat.numel()
        if not self.fits(n):
            raise ValueError(f"hidden rows of {n} bytes ({rows.shape[0]} rows) do not fit the CUDA IPC slot "
                             f"of {self.capacity} bytes")
        stream.wait_event(self.read)                  # the receiver copied the previous frame out
        with torch.cuda.stream(stream):
            if n:
                self.buf[:n].view_as(flat).copy_(flat)
            self.written.record(stream)
        rows.record_stream(stream)                    # the caller drops rows before this copy ran
        return flat.shape[0], flat.shape[1]


class IpcReceiver:
    """The receiver's end: maps the sender's slot, opens `written`, owns the `read` event."""

    def __init__(self, device: torch.device, spec: bytes):
        peer = json.loads(spec)
        if "error" in peer:
            raise RuntimeError(f"the target could not share its CUDA IPC slot: {peer['error']}")
        self.device, self.capacity = device, int(peer["capacity"])
        if int(peer["size"]) < self.capacity:
            raise RuntimeError(f"CUDA IPC slot storage holds {peer['size']} bytes, the sender says {self.capacity}")
        index = _index(device)                        # this process's index of the GPU (the sender's may differ)
        storage = torch.UntypedStorage._new_shared_cuda(
            index, bytes.fromhex(peer["handle"]), int(peer["size"]), int(peer["offset"]),
            bytes.fromhex(peer["ref_counter"]), int(peer["ref_counter_offset"]),
            _unhex(peer["event"]), bool(peer["event_sync"]))
        # [capacity] bytes, mapped; held (with the mapping) for the channel's life
        self.buf = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage, 0, (self.capacity,), (1,))
        self.written = torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), bytes.fromhex(peer["written"]))
        self.read = torch.cuda.Event(interprocess=True)

    def answer(self) -> str:
        return json.dumps({"read": _hex(self.read.ipc_handle())})

    def copy_out(self, n_rows: int, row_bytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """Frame [n_rows, row_bytes] out of the slot on `stream`; records `read`. The caller
        synchronizes `stream` before the next pull (and before it uses the rows)."""
        n = n_rows * row_bytes
        if n > self.capacity:
            raise ValueError(f"frame of {n_rows} rows x {row_bytes} bytes exceeds the CUDA IPC slot "
                             f"of {self.capacity} bytes")
        stream.wait_event(self.written)
        with torch.cuda.stream(stream):
            out = self.buf[:n].view(n_rows, row_bytes).clone()
            self.read.record(stream)
        return out


def error_answer(e: Exception) -> str:
    return json.dumps({"error": f"{type(e).__name__}: {e}"})


def _hex(b: bytes | None) -> str | None:
    return None if b is None else b.hex()


def _unhex(s: str | None) -> bytes | None:
    return None if s is None else bytes.fromhex(s)
