"""The bridge: a two-rank torch.distributed channel that moves hidden rows target -> draft.

Rank 0 (target) sends, rank 1 (draft) receives; gloo on CPU, NCCL between GPUs. The group is
built from its own TCPStore rendezvous (not the target's TP group), so either side can start first.
Each transfer is a frame: a header [transfer_id, rows, cols_in_bytes] then the payload as bytes.
The sender queues frames to a thread, so a step never waits on the draft; the receiver's thread
posts receives continuously and files frames in a mailbox that Propose takes from by transfer id.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("tandem.bridge")
MAILBOX_TTL_S = 120.0


class RowChannel:
    def __init__(self, address: str, role: str, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 600.0):
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be sender or receiver, got {role!r}")
        host, port = address.rsplit(":", 1)
        self.role, self.backend, self.device = role, backend, torch.device(device)
        self.rank, self.peer = (0, 1) if role == "sender" else (1, 0)
        self._timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, int(port), 2, role == "sender", timeout=self._timeout,
                                    wait_for_workers=False)
        self._pg = None
        self._ready = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        # GPU: the channel's own stream, so a posted receive never stalls the model's stream
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._mailbox: dict[int, tuple[float, torch.Tensor]] = {}
        self._arrived = threading.Condition()
        self.error: str | None = None
        threading.Thread(target=self._run, daemon=True, name=f"bridge-{role}").start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def _connect(self):
        store = dist.PrefixStore("tandem-bridge/0", self._store)
        if self.backend == "nccl":
            self._pg = dist.ProcessGroupNCCL(store, self.rank, 2)
        else:
            self._pg = dist.ProcessGroupGloo(store, self.rank, 2, self._timeout)
        self._ready.set()
        log.info("bridge %s connected (%s, %s)", self.role, self.backend, self.device)

    def _run(self):
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)   # the current device is per thread
            self._connect()
            (self._send_loop if self.role == "sender" else self._recv_loop)()
        except Exception as e:  # the channel is gone; callers fall back to inline rows
            self.error = f"{type(e).__name__}: {e}"
            log.error("bridge %s failed: %s", self.role, self.error)

    # --- sender --------------------------------------------------------------------------------
    def send(self, transfer_id: int, rows: torch.Tensor) -> None:
        """Queue rows [N, D] for the draft; returns at once (GPU: ordered after the caller's stream)."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        self._outbox.put((transfer_id, rows.detach().contiguous(), ready))

    def _send_loop(self):
        while True:
            tid, rows, ready = self._outbox.get()
            with _on(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                payload = rows.view(torch.uint8).reshape(rows.shape[0], -1).to(self.device)
                header = torch.tensor([tid, payload.shape[0], payload.shape[1], _DTYPE_CODE[rows.dtype]],
                                      dtype=torch.int64, device=self.device)
                self._pg.send([header], self.peer, 0).wait()
                if payload.numel():
                    self._pg.send([payload], self.peer, 1).wait()
                if self._stream is not None:
                    self._stream.synchronize()     # rows may be reused by the caller after this

    # --- receiver ------------------------------------------------------------------------------
    def _recv_loop(self):
        while True:
            with _on(self._stream):
                header = torch.empty(4, dtype=torch.int64, device=self.device)
                self._pg.recv([header], self.peer, 0).wait()
                tid, n, nbytes, code = header.tolist()
                payload = torch.empty(n, nbytes, dtype=torch.uint8, device=self.device)
                if payload.numel():
                    self._pg.recv([payload], self.peer, 1).wait()
                if self._stream is not None:
                    self._stream.synchronize()     # complete before any other stream reads it
            dtype = _CODE_DTYPE[code]
            rows = payload.view(dtype).reshape(n, nbytes // (torch.finfo(dtype).bits // 8))
            with self._arrived:
                now = time.monotonic()
                for old in [k for k, (t, _) in self._mailbox.items() if now - t > MAILBOX_TTL_S]:
                    del self._mailbox[old]   # never claimed (its Propose failed or never came)
                self._mailbox[tid] = (now, rows)
                self._arrived.notify_all()

    def take(self, transfer_id: int, timeout_s: float) -> torch.Tensor:
        """The rows of `transfer_id`, waiting up to timeout_s for them to arrive."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while transfer_id not in self._mailbox:
                left = deadline - time.monotonic()
                if left <= 0 or self.error:
                    raise TimeoutError(f"hidden rows transfer {transfer_id} did not arrive within "
                                       f"{timeout_s:.1f}s" + (f" (bridge: {self.error})" if self.error else ""))
                self._arrived.wait(left)
            return self._mailbox.pop(transfer_id)[1]

    def discard(self, transfer_id: int) -> None:
        with self._arrived:
            self._mailbox.pop(transfer_id, None)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
