"""How the two ends of the hidden-row bridge (channel.py) find each other, at start-up and again
after either restarts: the store, the handshake, the generations.

Handshake: before any transport exists, each side publishes its `hello` (model identity and
contract version) in the store and reads its peer's; a mismatch ends the channel on both sides with
an error naming both values, so rows never move between different models. Then each publishes its
endpoint (requested transport, device, GPU UUID, process) under its own keys (devices differ
legitimately, so they are not part of `hello`); both sides compute the transport from the same two
records, so they agree, or both fail naming both.
The store's server listens on the bridge address's host only (loopback by default), never on all
interfaces: TCPStore binds every interface unless handed a socket (services/rendezvous.py).

Generations: a draft that joins (at start, after a restart, or when its channel broke: a frame announced
and not received in time, or a failed receive) takes the next number of the store's JOINS counter, and both sides
handshake and open a transport again under that generation's keys, exactly as at start-up (link.py
holds one generation). The target serves the newest join only: a watcher thread (its own store client)
sees it within JOIN_POLL_S and wakes the store wait the target's thread is in, which closes the old
generation (NCCL: aborted; frames not pushed yet dropped) and pairs with the new draft. The draft checks every
KEEPALIVE_S that the target's store still answers; once the target restarted it connects to the new
store and joins again. `state()` is what GetInfo reports: the transport connected now ("" while none
is) and the generation; the gateway sends rows on the bridge again once both sides report the same.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from services.bridge.ipc import IpcReceiver, IpcSender, error_answer
from services.bridge.shm import ShmReceiver, ShmSender
from services.bridge.link import Link
from services.bridge import push
from services.bridge.push import FOREVER, WAKE, Frames, start_drain, wake
from services.bridge.transport import TransportError, choose_transport, endpoint
from services.rendezvous import tcp_store

log = logging.getLogger("tandem.bridge")
JOINS = "tandem-bridge/joins"     # drafts that joined this store so far; the newest is the generation served
JOIN_POLL_S = 0.2                 # target: how often its watcher looks for a newer join
KEEPALIVE_S = 1.0                 # draft: how often it checks that the target's store still answers
REJOIN_S = 1.0                    # draft: pause before it joins again after its generation failed


class HandshakeError(RuntimeError):
    """Target and draft are not the same model (or not the same contract)."""


class Superseded(Exception):
    """Target: a newer draft joined; leave this generation."""


class Generations:
    """The generations of one end of a bridge: its store, the generation it is in, the link (link.py)
    it opened for it, and whether that link is ready. RowChannel (channel.py) adds what moves rows;
    its `_serve_pushes` pushes one generation's frames on the target."""

    def __init__(self, host: str, port: int, role: str, backend: str, device: torch.device, timeout_s: float,
                 hello: dict | None, ipc_bytes: int):
        self.role, self.backend, self.device = role, backend, device
        self.rank = 0 if role == "sender" else 1
        self._peer_role = "receiver" if role == "sender" else "sender"
        self._host, self._port = host, port
        self._timeout = timedelta(seconds=timeout_s)
        self._store = tcp_store(host, port, 2, role == "sender", self._timeout)
        self.hello = dict(hello or {})                # what the peer must match: model_identity, contract_version
        self._ipc_bytes = ipc_bytes
        self.transport: str | None = None             # gloo | nccl | ipc, as last agreed
        self.generation = 0                           # joined (draft) or served (target); 0: none yet
        self._link: Link | None = None                # the generation connected now
        self._rings: dict[str, IpcSender | ShmSender] = {}   # target: its rings by transport (ipc, shm), reused
        self._ready = threading.Event()
        self._frames = Frames()                       # target: frames not pushed yet; draft: landed, not taken
        self._lock = threading.Condition()            # the link, parked rows, the draft's store client
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.error: str | None = None
        self._cond = threading.Condition()            # target: generation, _latest, _waiting
        self._latest = 0                              # target: the newest join its watcher saw
        self._waiting: str | None = None              # target: the store key its thread waits for now
        self._broken = threading.Event()              # draft: take() found this generation broken
        self._closed = threading.Event()              # close(): the background threads stop

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def state(self) -> tuple[str, int]:
        """(the transport connected now, "" while none is; the generation) as GetInfo reports them."""
        return (self.transport or "") if self.ready else "", self.generation

    def close(self) -> None:
        """Stop joining and serving (a thread in a store call stops when the call returns) and close the link."""
        self._closed.set()
        self._broken.set()
        with self._cond:
            self._latest = max(self._latest, self.generation + 1)      # wakes the sender's wait
            self._cond.notify_all()
        self._close()

    def _run(self):
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)       # the current device is per thread
        (self._sender_loop if self.role == "sender" else self._receiver_loop)()

    # --- generations ---------------------------------------------------------------------------
    def _sender_loop(self):
        """Target: serve the newest draft that joined, one generation at a time."""
        threading.Thread(target=self._watch_joins, daemon=True, name="bridge-joins").start()
        while not self._closed.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._latest > self.generation)
                gen = self._latest
            if self._closed.is_set():
                return
            try:
                self._connect(gen)
                if self._link.ipc is not None:       # IPC: nothing to serve until a newer draft joins
                    with self._cond:
                        self._cond.wait_for(lambda: self._latest > self.generation)
                    raise Superseded
                self._serve_pushes()                 # until Superseded, or an error (the draft is gone)
            except Superseded:
                log.info("bridge sender: a draft joined again; leaving generation %d", gen)
            except Exception as e:                   # the peer is gone, or another model: wait for a new join
                self._failed(e)
            self._close()

    def _watch_joins(self):
        """Target: see a newer join; wake the store wait the sender's thread is in (own client: a store
        client runs one operation at a time, and that thread's may be a long wait)."""
        client = tcp_store(self._host, self._port, 2, False, self._timeout)
        while not self._closed.is_set():
            try:
                latest = int(client.add(JOINS, 0))
                with self._cond:
                    key = None
                    if latest > self.generation:
                        self._latest, key = latest, self._waiting
                        self._cond.notify_all()
                if key is not None:
                    client.compare_set(key, "", WAKE)     # only where the draft has not written it
                self._unstick(latest)
            except Exception:                             # the watcher must outlive any surprise
                log.exception("bridge sender: watching for new drafts failed")
            self._closed.wait(JOIN_POLL_S)

    def _unstick(self, latest: int) -> None:
        """Target: a push in flight that a newer draft superseded, or that the draft has not received within
        PUSH_TIMEOUT_S (it died or hangs), ends its generation: closing the link aborts an NCCL group, which
        frees the stream the push waits on (push.py)."""
        link = self._link
        since = link.pushing_since if link is not None else None
        if since is not None and (latest > link.generation or time.monotonic() - since > push.PUSH_TIMEOUT_S):
            log.error("bridge sender: a push of generation %d is not received after %.1fs%s; closing it",
                      link.generation, time.monotonic() - since, " (a newer draft joined)" if latest > link.generation
                      else "")
            link.close()

    def _receiver_loop(self):
        """Draft: join, keep the generation until it breaks, join again (after a target restart: its new store)."""
        while not self._closed.is_set():
            try:
                if self._store is None:
                    store = tcp_store(self._host, self._port, 2, False, self._timeout)
                    with self._lock:
                        self._store = store
                self._connect(int(self._store.add(JOINS, 1)))
                while not self._broken.wait(KEEPALIVE_S):
                    with self._lock:
                        self._store.check([JOINS])   # raises once the target's store is gone
                if self._closed.is_set():
                    return
                log.warning("bridge receiver: generation %d broke (%s); joining again", self.generation, self.error)
            except (HandshakeError, TransportError) as e:
                self._failed(e)                      # another model or transport: joining again cannot help
                return self._close()
            except Exception as e:
                self._failed(e)
            self._close()
            with self._lock:
                self._store = None                   # a new client: the old one may be out of step or dead
            self._closed.wait(REJOIN_S)

    def _connect(self, gen: int) -> None:
        """Handshake and open a transport under generation `gen`'s keys, as at start-up."""
        with self._cond:
            self.generation = gen
        self.error = None
        self._broken.clear()
        prefix = f"tandem-bridge/{gen}/"
        self._handshake(prefix)
        transport = self._agree(prefix)
        link = Link(gen, prefix, transport, self.rank, torch.device("cpu") if transport == "gloo" else self.device)
        if transport in ("ipc", "shm"):
            link.ipc = self._open_ring(prefix, transport)
        else:
            store = dist.PrefixStore(prefix + "pg", self._store)
            link.pg = (dist.ProcessGroupNCCL(store, self.rank, 2) if transport == "nccl"
                       else dist.ProcessGroupGloo(store, self.rank, 2, self._timeout))
        self._frames.clear()                          # (target: frames made while no draft was connected)
        with self._lock:
            self._link, self.transport = link, transport
        if link.pg is not None and self.role == "receiver":    # its own client: it waits for every header
            start_drain(link, tcp_store(self._host, self._port, 2, False, FOREVER), self._frames, self._stream,
                        self.device, self._drain_failed)
        self._ready.set()
        log.info("bridge %s connected (%s, %s, generation %d)", self.role, transport, self.device, gen)

    def _failed(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {e}"
        log.error("bridge %s failed (generation %d): %s", self.role, self.generation, self.error)

    def _drain_failed(self, e: Exception) -> None:
        """Draft: a receive failed; this generation is broken (the receiver loop joins again)."""
        self._failed(e)
        self._ready.clear()
        self._frames.clear(broken=True)
        self._broken.set()

    def _close(self) -> None:
        """End the generation: not ready, its frames dropped (takes waiting stop), its drain stopped, its transport
        closed."""
        self._ready.clear()
        with self._lock:
            link, self._link = self._link, None
            self._frames.clear(broken=self.role == "receiver")
            if link is not None and link.drain is not None:
                wake(link, self._store)               # its drain thread leaves its store call
        if link is not None:
            link.close()
            if link.drain is not None:
                link.drain.join(timeout=1.0)         # out of its store call (not left in C++ at interpreter exit)

    def _wait(self, key: str, timeout: timedelta) -> bytes:
        """The value of `key` once set. Target: Superseded when a newer draft joined meanwhile (its
        watcher then wakes this wait)."""
        with self._cond:
            if self._latest > self.generation:
                raise Superseded
            self._waiting = key
        try:
            self._store.wait([key], timeout)
        finally:
            with self._cond:
                self._waiting = None
                superseded = self._latest > self.generation
        if superseded:
            raise Superseded
        return self._store.get(key)

    def _exchange(self, prefix: str, name: str, value: str | bytes) -> bytes:
        """Publish this side's `name`, wait for the peer's and return it."""
        self._store.set(f"{prefix}{name}/{self.role}", value)
        return self._wait(f"{prefix}{name}/{self._peer_role}", self._timeout)

    def _handshake(self, prefix: str) -> None:
        """Publish hello, wait for the peer's; HandshakeError naming both sides' values on a mismatch."""
        peer = json.loads(self._exchange(prefix, "hello", json.dumps(self.hello)))
        target, draft = (self.hello, peer) if self.role == "sender" else (peer, self.hello)
        bad = [f"{k}: target {target.get(k)!r}, draft {draft.get(k)!r}"
               for k in sorted(set(target) | set(draft)) if target.get(k) != draft.get(k)]
        if bad:
            raise HandshakeError("target and draft are not the same model; refusing to pair on the hidden-rows "
                                 "bridge (" + "; ".join(bad) + ")")

    def _agree(self, prefix: str) -> str:
        """Both sides compute the transport from the same two endpoint records."""
        mine = endpoint(self.backend, self.device)
        peer = json.loads(self._exchange(prefix, "endpoint", json.dumps(mine)))
        return choose_transport(*((mine, peer) if self.role == "sender" else (peer, mine)))

    def _open_ring(self, prefix: str, transport: str):
        """A ring of pushed frames, CUDA IPC or shared host memory. Sender: share its ring (allocated once),
        attach the receiver's answer; receiver: map it and answer. A side that fails publishes its error
        instead, so the other fails at once naming it."""
        sender = self.role == "sender"
        mine, theirs = f"{prefix}ipc/{self.role}", f"{prefix}ipc/{self._peer_role}"
        spec = None if sender else self._wait(theirs, self._timeout)
        try:
            if sender and transport not in self._rings:
                self._rings[transport] = (IpcSender(self.device, self._ipc_bytes) if transport == "ipc"
                                          else ShmSender())
            if sender:
                slot = self._rings[transport]
            else:
                slot = IpcReceiver(self.device, spec) if transport == "ipc" else ShmReceiver(spec)
            self._store.set(mine, slot.spec() if sender else slot.answer())
        except Exception as e:
            self._store.set(mine, error_answer(e))
            raise
        if sender:
            slot.attach(self._wait(theirs, self._timeout))
        return slot

    def _serve_pushes(self) -> None:
        raise NotImplementedError
