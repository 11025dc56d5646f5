"""Shared host memory for the hidden-row bridge when target and draft are two processes on the CPUs of one
host (transport shm): the target pushes each transfer into a ring of slots as it sends it, the draft copies
it out when it asks. No store round trip, no gloo frame, no thread serving pulls on the target.

The ring follows ipc.py's protocol without device events: per slot a header [transfer id, rows, bytes per
row, dtype code] (ipc.SlotHeaders); the sender sets the id to -1 before it overwrites a slot and publishes
the new id last; the receiver reads the id before and after its copy and uses the frame only if both equal
the transfer asked for, so a slot overwritten during the copy is reported gone, never mixed. That check
relies on stores and loads not being reordered across the header (x86-64's total store order), so `auto`
picks shm only on x86-64 (transport.py); elsewhere it stays gloo.

Both sides must see one /dev/shm: `shm_identity` (boot id, the /dev/shm mount's device and inode) is part
of each side's endpoint record, so two containers with private /dev/shm never agree on shm.
Capacity: small by default (docker gives containers 64 MiB of /dev/shm); a frame larger than a slot goes
inline, as with CUDA IPC.
"""
from __future__ import annotations

import atexit
import json
import os
from multiprocessing import resource_tracker, shared_memory

import torch

from services.bridge.ipc import DEFAULT_SLOTS, SlotHeaders
from services.bridge.segments import segment_name, sweep_orphans

DEFAULT_SHM_CAPACITY = 32 << 20   # bytes over all slots: 4 MiB a frame (4096 rows of hidden 256 in fp32)


def shm_identity() -> str:
    """The same string in two processes that share a /dev/shm; "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat("/dev/shm")
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


class ShmSender:
    """The sender's end: owns the segment and the headers. Build, publish `spec()`, `attach()` the answer."""

    def __init__(self, capacity: int = DEFAULT_SHM_CAPACITY, slots: int = DEFAULT_SLOTS):
        if capacity < slots or slots < 1:
            raise ValueError(f"shared-memory ring: {slots} slots in {capacity} bytes")
        self.slots, self.slot_bytes = slots, capacity // slots
        sweep_orphans("rows")
        self.shm = shared_memory.SharedMemory(name=segment_name("rows"), create=True,
                                              size=slots * self.slot_bytes)
        self.buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8)              # [slots * slot_bytes]
        self.buf.zero_()                     # touch every page now: a /dev/shm too small fails here, not later
        self.headers = SlotHeaders(slots)
        atexit.register(self.close)

    def spec(self) -> str:
        return json.dumps({"slots": self.slots, "slot_bytes": self.slot_bytes, "segment": self.shm.name,
                           "headers": self.headers.name})

    def attach(self, answer: bytes) -> None:
        peer = json.loads(answer)
        if "error" in peer:
            raise RuntimeError(f"the draft could not map the shared-memory ring: {peer['error']}")

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def push(self, tid: int, rows: torch.Tensor, code: int, stream=None) -> None:
        """Copy rows [N, D] (CPU) into slot tid % slots and publish its header."""
        row_bytes = rows.shape[1] * rows.element_size()
        flat = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)   # [N, row bytes]
        n = flat.numel()
        if not self.fits(n):
            raise ValueError(f"hidden rows of {n} bytes ({rows.shape[0]} rows) do not fit a shared-memory "
                             f"slot of {self.slot_bytes} bytes")
        slot = tid % self.slots
        self.headers.invalidate(slot)
        if n:
            start = slot * self.slot_bytes
            self.buf[start:start + n].view_as(flat).copy_(flat)
        self.headers.publish(slot, tid, flat.shape[0], row_bytes, code)

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf = None                      # the view must go before the mapping can close
        self.headers.close()
        self.shm.close()
        self.shm.unlink()


class ShmReceiver:
    """The receiver's end: maps the sender's segment and headers (the sender unlinks them)."""

    def __init__(self, spec: bytes):
        peer = json.loads(spec)
        if "error" in peer:
            raise RuntimeError(f"the target could not share its shared-memory ring: {peer['error']}")
        self.slots, self.slot_bytes = int(peer["slots"]), int(peer["slot_bytes"])
        self.shm = shared_memory.SharedMemory(name=peer["segment"])
        resource_tracker.unregister(self.shm._name, "shared_memory")          # not ours to unlink
        if self.shm.size < self.slots * self.slot_bytes:
            raise RuntimeError(f"shared-memory ring holds {self.shm.size} bytes, the sender says "
                               f"{self.slots * self.slot_bytes}")
        self.buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8)[:self.slots * self.slot_bytes]
        self.headers = SlotHeaders(self.slots, peer["headers"])

    def answer(self) -> str:
        return json.dumps({"mapped": self.shm.name})

    def take(self, tid: int, stream=None, then=None, wait_s: float = 0.0):   # then: IpcReceiver.take's (CUDA only)
        """-> (rows [N, bytes per row] uint8, dtype code), or None when transfer `tid` is not (or no longer)
        in its slot (not yet there: waited for up to wait_s)."""
        slot = tid % self.slots
        header = self.headers.wait(slot, tid, wait_s)
        if header is None:
            return None
        n_rows, row_bytes, code = header
        start = slot * self.slot_bytes
        out = self.buf[start:start + n_rows * row_bytes].view(n_rows, row_bytes).clone()
        return (out, code) if self.headers.tid(slot) == tid else None          # overwritten meanwhile: gone

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf = None
        self.headers.close()
        self.shm.close()
