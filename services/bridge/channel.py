"""The bridge: a two-rank torch.distributed channel that moves hidden rows target -> draft.

Rank 0 (target) sends, rank 1 (draft) receives; gloo on CPU, NCCL between GPUs. The group is
built from its own TCPStore rendezvous (not the target's TP group), so either side can start first.

Pull, not push: the target parks each transfer's rows under its id and answers when the draft
asks for that id. No point-to-point operation is ever left posted while its peer is busy: an
outstanding NCCL receive (or send) deadlocks against work that synchronizes the device (a
cudaMalloc, a pageable copy) on that side. A request goes through the store; the target acks it
(so the draft can time out on the CPU without posting anything) and then sends a frame:
a header [transfer_id, rows, bytes per row, dtype] and the payload as bytes, on the channel's own
CUDA stream. Parked rows not pulled within PARK_TTL_S are dropped.

Handshake: before any process group exists, each side publishes its `hello` (model identity and
contract version) in the store and reads its peer's; a mismatch ends the channel on both sides with
an error naming both values, so rows never move between different models.
The store's server listens on the bridge address's host only (loopback by default), never on all
interfaces: TCPStore binds every interface unless handed a socket (`tcp_store`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("tandem.bridge")
PARK_TTL_S = 120.0
_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (is_master) listens on `host`'s address only."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())         # the store owns the fd from here


class HandshakeError(RuntimeError):
    """Target and draft are not the same model (or not the same contract)."""


class RowChannel:
    def __init__(self, address: str, role: str, backend: str = "gloo", device: str = "cpu",
                 timeout_s: float = 600.0, hello: dict | None = None):
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be sender or receiver, got {role!r}")
        host, port = address.rsplit(":", 1)
        self.role, self.backend, self.device = role, backend, torch.device(device)
        self.rank, self.peer = (0, 1) if role == "sender" else (1, 0)
        self._timeout = timedelta(seconds=timeout_s)
        self._store = tcp_store(host, int(port), 2, role == "sender", self._timeout)
        self.hello = dict(hello or {})                # what the peer must match: model_identity, contract_version
        self._prefix = "tandem-bridge/0/"
        self._pg = None
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
            store = dist.PrefixStore(self._prefix + "pg", self._store)
            if self.backend == "nccl":
                self._pg = dist.ProcessGroupNCCL(store, self.rank, 2)
            else:
                self._pg = dist.ProcessGroupGloo(store, self.rank, 2, self._timeout)
            self._ready.set()
            log.info("bridge %s connected (%s, %s)", self.role, self.backend, self.device)
            if self.role == "sender":
                self._serve_pulls()
        except Exception as e:  # the channel is gone; the target falls back to inline rows
            self.error = f"{type(e).__name__}: {e}"
            log.error("bridge %s failed: %s", self.role, self.error)

    def _handshake(self) -> None:
        """Publish hello, wait for the peer's; HandshakeError naming both sides' values on a mismatch."""
        peer_role = "receiver" if self.role == "sender" else "sender"
        self._store.set(f"{self._prefix}hello/{self.role}", json.dumps(self.hello))
        key = f"{self._prefix}hello/{peer_role}"
        self._store.wait([key], self._timeout)
        peer = json.loads(self._store.get(key))
        target, draft = (self.hello, peer) if self.role == "sender" else (peer, self.hello)
        bad = [f"{k}: target {target.get(k)!r}, draft {draft.get(k)!r}"
               for k in sorted(set(target) | set(draft)) if target.get(k) != draft.get(k)]
        if bad:
            raise HandshakeError("target and draft are not the same model; refusing to pair on the hidden-rows "
                                 "bridge (" + "; ".join(bad) + ")")

    # --- sender (target) -----------------------------------------------------------------------
    def send(self, transfer_id: int, rows: torch.Tensor) -> None:
        """Park rows [N, D] under transfer_id until the draft pulls them; returns at once."""
        ready = None
        if self._stream is not None:                 # the rows are complete once the caller's stream is
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
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
                    payload = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).to(self.device)
                    header = torch.tensor([tid, payload.shape[0], payload.shape[1], _DTYPE_CODE[rows.dtype]],
                                          dtype=torch.int64, device=self.device)
                    self._pg.send([header], self.peer, 0).wait()
                    if payload.numel():
                        self._pg.send([payload], self.peer, 1).wait()
                    if self._stream is not None:
                        self._stream.synchronize()
            n += 1

    # --- receiver (draft) ----------------------------------------------------------------------
    def take(self, transfer_id: int, timeout_s: float) -> torch.Tensor:
        """Pull the rows of `transfer_id` [N, D]; TimeoutError if the target does not answer."""
        if self.error or not self._ready.wait(timeout_s) or self.error:    # a failed channel answers at once
            raise TimeoutError("hidden rows bridge not connected" + (f": {self.error}" if self.error else ""))
        with self._lock:                              # one pull at a time, in order
            n = self._pulls
            self._pulls += 1
            self._store.set(f"{self._prefix}pull/{n}", str(transfer_id))
            ack = f"{self._prefix}ack/{n}"
            try:
                self._store.wait([ack], timedelta(seconds=timeout_s))
            except Exception:
                self.error = f"target did not answer pull {n} within {timeout_s:.1f}s"
                raise TimeoutError(f"hidden rows transfer {transfer_id}: {self.error}") from None
            if self._store.get(ack) != b"1":        # a LookupError: the caller answers NOT_FOUND
                raise LookupError(f"hidden rows transfer {transfer_id} is not held by the target "
                                  f"(expired, already taken, or never sent)")
            with _on(self._stream):
                header = torch.empty(4, dtype=torch.int64, device=self.device)
                self._pg.recv([header], self.peer, 0).wait()
                tid, n_rows, nbytes, code = header.tolist()
                payload = torch.empty(n_rows, nbytes, dtype=torch.uint8, device=self.device)
                if payload.numel():
                    self._pg.recv([payload], self.peer, 1).wait()
                if self._stream is not None:
                    self._stream.synchronize()
            if tid != transfer_id:                    # the channel is out of step: never use it again
                self.error = f"pulled transfer {transfer_id}, received frame {tid}"
                raise TimeoutError(f"hidden rows bridge: {self.error}")
        dtype = _CODE_DTYPE[code]
        return payload.view(dtype).reshape(n_rows, nbytes // (torch.finfo(dtype).bits // 8))

    def discard(self, transfer_id: int) -> None:
        """Receiver side: nothing to free (rows are only moved when pulled)."""


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
