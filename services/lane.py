"""A service's round call (the target's Verify, the draft's Propose) on a local socket (infra/lane_wire.py).

gRPC hands each message of a stream from its completion-queue thread to the stream's handler thread: two
threads that sleep between rounds wake for every call, each after 0.1-0.4 ms on the hosts measured (BENCHMARKS.md
"The hops of a call"). Here one thread a connection reads the request, runs the same unary handler and writes
the answer (a PUSH is run and not answered); between calls it spins for `spin_s` (a GPU service: its host has
cores to spare, and the next call comes within a round) before it blocks in the kernel. The handler sees a
context with the gRPC methods the services use (abort, code, is_active, time_remaining), so it runs unchanged.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

from infra import lane_wire as wire
from infra.grpc_server import internal_details

log = logging.getLogger("tandem.lane")


class LaneAbort(Exception):
    def __init__(self, code, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class LaneContext:
    """What a unary handler uses of grpc.ServicerContext, for one call on a lane."""

    def __init__(self, conn: socket.socket):
        self.conn, self._code = conn, None

    def abort(self, code, details: str):
        self._code = code
        raise LaneAbort(code, details)

    def code(self):
        return self._code

    def time_remaining(self):
        return None                        # a lane's call has no deadline of its own (the gateway keeps it)

    def is_active(self) -> bool:
        """False once the gateway closed its end (it gave up on the call: timeout, cancellation)."""
        return not wire.peer_closed(self.conn)


def recv_exact(conn: socket.socket, n: int, spin_until: float) -> bytes | None:
    """n bytes from `conn` (None: the peer closed first). Until `spin_until` (perf_counter) it polls without
    sleeping; after it, it blocks."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = conn.recv_into(view[got:], n - got, socket.MSG_DONTWAIT if time.perf_counter() < spin_until else 0)
        except BlockingIOError:
            continue
        except OSError:                      # reset by the peer
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)


def read_frame(conn: socket.socket, spin_until: float, max_bytes: int) -> tuple[int, bytes] | None:
    head = recv_exact(conn, wire.HEADER.size, spin_until)
    if head is None:
        return None
    n, kind = wire.HEADER.unpack(head)
    if n > max_bytes:
        raise ValueError(f"a lane frame of {n} bytes, over --max-message-bytes {max_bytes}")
    payload = recv_exact(conn, n, spin_until) if n else b""
    return None if payload is None else (kind, payload)


class LaneServer:
    """Serves `call(request, context, received_at) -> response` for `method` on an abstract Unix socket;
    `name` is what GetInfo announces. One thread a connection (a gateway), its calls run in order."""

    def __init__(self, method: str, request_cls, call, spin_s: float = 0.0, max_bytes: int = 256 << 20,
                 spin_after=None):
        self.method, self.request_cls, self.call = method, request_cls, call
        self.spin_s, self.max_bytes = spin_s, max_bytes
        self.spin_after = spin_after or (lambda request: True)   # whether the next call after this one is urgent
        self.name = f"tandem-{method.rsplit('/', 1)[-1].lower()}-{os.getpid()}-{os.urandom(6).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(wire.address(self.name))
        self.sock.listen(16)
        self.closed = False
        if spin_s > 0:
            # a spinning reader holds the GIL between its polls: bound how long another of the service's threads
            # (a unary Prefill or Release arriving over gRPC) waits for it to 0.2 ms, not the default 5 ms
            sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        threading.Thread(target=self._accept, name="lane-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="lane", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            hello = read_frame(conn, 0.0, 4096)
            if hello is None or hello[0] != wire.HELLO or hello[1].decode("utf-8", "replace") != self.method:
                asked = hello[1][:200].decode("utf-8", "replace") if hello else "nothing"
                conn.sendall(wire.frame(wire.ERROR, wire.error_payload(
                    "FAILED_PRECONDITION", f"this lane serves {self.method}, the client asked for {asked}")))
                return
            conn.sendall(wire.frame(wire.RESPONSE))
            spin = self.spin_s
            while True:
                try:
                    got = read_frame(conn, time.perf_counter() + spin, self.max_bytes)
                except ValueError as e:
                    conn.sendall(wire.frame(wire.ERROR, wire.error_payload("RESOURCE_EXHAUSTED", str(e))))
                    return
                if got is None:
                    return
                answer, request = self._answer(conn, *got)
                if got[0] != wire.PUSH:
                    conn.sendall(answer)
                elif answer and wire.HEADER.unpack_from(answer)[1] == wire.ERROR:    # nobody reads it: said here
                    log.warning("%s: a pushed call failed: %s", self.method,
                                ": ".join(wire.parse_error(answer[wire.HEADER.size:])))
                spin = self.spin_s if request is None or self.spin_after(request) else 0.0
        except OSError as e:                  # the gateway went away while it was answered: its call is gone
            log.debug("%s lane: %s", self.method, e)
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, kind: int, payload: bytes) -> tuple[bytes, object]:
        """One REQUEST or PUSH -> (its RESPONSE or ERROR frame, as the gRPC stream would have answered
        (services/servicer.py), the request or None where it did not parse)."""
        received = time.perf_counter()
        if kind not in (wire.REQUEST, wire.PUSH):
            return wire.frame(wire.ERROR, wire.error_payload("INVALID_ARGUMENT", f"a lane frame of kind {kind}, "
                                                             f"expected a request ({wire.REQUEST}) or a push "
                                                             f"({wire.PUSH})")), None
        try:
            request = self.request_cls.FromString(payload)
        except Exception as e:                # protobuf's DecodeError
            return wire.frame(wire.ERROR, wire.error_payload(
                "INVALID_ARGUMENT", f"{self.method}: the request is not a {self.request_cls.__name__} ({e})")), None
        ctx = LaneContext(conn)
        if not ctx.is_active():               # the gateway gave up before it was read: nothing is run
            return b"", request
        try:
            return wire.frame(wire.RESPONSE, self.call(request, ctx, received).SerializeToString()), request
        except LaneAbort as e:
            return wire.frame(wire.ERROR, wire.error_payload(e.code.name, e.details)), request
        except Exception as e:               # as infra/grpc_server.InternalErrors: INTERNAL, named, logged
            log.exception("%s failed", self.method)
            return wire.frame(wire.ERROR, wire.error_payload("INTERNAL", internal_details(self.method, e))), request

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
