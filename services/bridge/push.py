"""Rows pushed over a process group (gloo, NCCL; services/bridge/channel.py): the target sends every transfer as
it makes it, the draft receives it as soon as it is announced, so a Propose finds its rows landed already.

Frame n of a generation: its header "transfer id,rows,bytes per row,dtype code" in the store under
<prefix>frame/<n>, then its payload by p2p (none for zero rows). The draft's drain thread waits for header n on
its own store client and only then posts the matching receive, so no receive is ever posted before its send is:
an NCCL receive left posted would block the draft's own device synchronizations until the target's next
Verify, which waits for the draft's proposals. The target's send waits only for the drain thread, never for the
draft's serving. A push the draft does not receive within PUSH_TIMEOUT_S (it died or hangs), or one still in
flight when a newer draft joins, ends the generation: the target's watcher aborts the NCCL group, which frees
the target's stream.

Frames land in order, so a take of transfer t that finds a later transfer landed and t not knows at once that t
is not coming (dropped on the target, or sent to an earlier generation). Landed frames not taken (the prompt
rows of a request the adaptive policy keeps at k = 0) are bounded like the target's queue: dropped after
PARK_TTL_S, and the oldest first past PARK_MAX_BYTES.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import torch

from services.bridge.rows import DTYPE_TO_PB, PB_TO_DTYPE

PARK_TTL_S = 120.0
PARK_MAX_BYTES = 1 << 30                          # rows queued (target) or landed untaken (draft), at most
PUSH_TIMEOUT_S = 30.0                             # a frame the draft has not received by then ends the generation
WAKE = b"wake"                                    # written into a key a thread waits for, to wake it
FOREVER = timedelta(days=365)


class Frames:
    """Transfers by id, oldest first, bounded (PARK_TTL_S, PARK_MAX_BYTES; one over the cap is kept): the
    target's queue of frames not pushed yet, the draft's frames landed and not taken."""

    def __init__(self):
        self._items: OrderedDict[int, tuple[float, torch.Tensor, object]] = OrderedDict()
        self.cond = threading.Condition()
        self.newest = 0                               # draft: the newest transfer landed in this generation
        self.announced = 0                            # draft: the newest whose header arrived
        self.broken = False                           # draft: its generation ended (takes stop waiting)

    def put(self, tid: int, rows: torch.Tensor, extra: object) -> None:
        with self.cond:
            now = time.monotonic()
            for t in [t for t, (at, _, _) in self._items.items() if now - at > PARK_TTL_S]:
                del self._items[t]
            self._items[tid] = (now, rows, extra)
            self.newest = max(self.newest, tid)
            held = sum(r.numel() * r.element_size() for _, r, _ in self._items.values())
            while held > PARK_MAX_BYTES and len(self._items) > 1:
                _, (_, r, _) = self._items.popitem(last=False)
                held -= r.numel() * r.element_size()
            self.cond.notify_all()

    def pop_first(self, timeout_s: float):
        """Target: the oldest queued frame (tid, rows, ready event), or None after timeout_s."""
        with self.cond:
            if not self._items and not self.cond.wait(timeout_s):
                return None
            if not self._items:
                return None
            tid, (_, rows, ready) = self._items.popitem(last=False)
            return tid, rows, ready

    def take(self, tid: int, wait_s: float, timeout_s: float):
        """Draft: -> (rows, finite) of transfer tid, removed; None when it is not coming (it or a later one landed,
        or it was not announced within wait_s); TimeoutError when it was announced and did not land in timeout_s,
        or the generation broke."""
        start = time.monotonic()
        with self.cond:
            while True:
                if tid in self._items:
                    _, rows, finite = self._items.pop(tid)
                    return rows, finite
                if self.broken:
                    raise TimeoutError("hidden rows bridge: the generation ended while waiting for transfer "
                                       f"{tid}")
                if self.newest >= tid:                  # landed in order: taken, dropped, or never sent
                    return None
                waited = time.monotonic() - start
                limit = timeout_s if self.announced >= tid else wait_s
                if waited >= limit:
                    if self.announced >= tid:
                        raise TimeoutError(f"hidden rows transfer {tid} announced but not received within "
                                           f"{timeout_s:.1f}s")
                    return None
                self.cond.wait(limit - waited)

    def announce(self, tid: int) -> None:
        with self.cond:
            self.announced = max(self.announced, tid)

    def clear(self, broken: bool = False) -> None:
        with self.cond:
            self._items.clear()
            self.newest = self.announced = 0
            self.broken = broken
            self.cond.notify_all()


def push_frame(link, store, tid: int, rows: torch.Tensor, ready, stream) -> None:
    """Target: frame link.frames: its header into the store, its payload on the group (after the caller's stream
    made the rows: `ready`); returns once the draft received it (link.pushing_since is set meanwhile, for the
    watcher's PUSH_TIMEOUT_S)."""
    row_bytes = rows.shape[1] * rows.element_size()
    store.set(f"{link.prefix}frame/{link.frames}", f"{tid},{rows.shape[0]},{row_bytes},{DTYPE_TO_PB[rows.dtype]}")
    link.frames += 1
    if not rows.shape[0]:
        return
    link.pushing_since = time.monotonic()
    try:
        with on_stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes).to(link.wire)
            work = link.pg.send([payload], link.peer, 1)
            if link.wire.type == "cuda":
                work.wait()                                         # the channel's stream waits for the send
                stream.synchronize()                                # released by the draft's receive or an abort
            else:
                work.wait(timedelta(seconds=PUSH_TIMEOUT_S))        # gloo: the peer's receive, or a timeout
    finally:
        link.pushing_since = None


def start_drain(link, client, frames: Frames, stream, device, failed) -> None:
    """Draft: receive a generation's frames on a thread of their own (link.drain), with `client` its own store
    client (it waits for every header)."""
    link.drain = threading.Thread(target=drain, args=(link, client, frames, stream, device, failed), daemon=True,
                                  name="bridge-drain")
    link.drain.start()


def drain(link, client, frames: Frames, stream, device, failed) -> None:
    """Draft, one generation: receive every frame as its header arrives, in order, into `frames` with whether its
    rows are finite; ends when the generation stops (link.stop, its key woken by `wake`) or fails (`failed(e)`)."""
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)               # the current device is per thread (the draft may be on cuda:1)
        while not link.stop.is_set():
            key = f"{link.prefix}frame/{link.frames}"
            header = client.get(key)                                # waits for the key (the client's timeout: FOREVER)
            if link.stop.is_set() or header == WAKE:
                return
            tid, n_rows, row_bytes, code = (int(x) for x in header.split(b","))
            frames.announce(tid)
            with on_stream(stream):
                payload = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device=link.wire)
                if n_rows:
                    link.pg.recv([payload], link.peer, 1).wait()
                rows = payload.view(PB_TO_DTYPE[code]).reshape(n_rows, row_bytes // PB_TO_DTYPE[code].itemsize)
                rows = rows.to(device)
                finite = not rows.numel() or bool(torch.isfinite(rows.sum(dtype=torch.float32)))   # synchronizes
            frames.put(tid, rows, finite)
            link.frames += 1
            client.delete_key(key)                                  # off the critical path: the rows landed
    except Exception as e:
        if not link.stop.is_set():
            failed(e)


def wake(link, client) -> None:
    """Stop a generation's drain thread: it waits for the key of the frame after the last it received."""
    link.stop.set()
    try:
        client.compare_set(f"{link.prefix}frame/{link.frames}", "", WAKE)
    except Exception:                                 # the store is gone: the drain's wait failed already
        pass


def on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
