"""A round's Verify or Propose over the service's local lane (services/lane.py, frames: infra/lane_wire.py)
where the service offers one (GetInfo `local_lane`) and this gateway reaches it: same host, same network
namespace. Anywhere else (another host or container, TLS, an older service) the call goes on the gRPC
stream of gateway/lanes.py, so the Scheduler sees one `Lane` either way: same request, same response, same
`timeout=`, failures raised as the grpc.aio.AioRpcError the service's status would be.

A failure the service answered (an ERROR frame) keeps the connection; a timeout, a cancellation or a broken
connection drops it, so a late answer is never read as the next call's, and the next call asks GetInfo for
the lane again (a restarted service has a new one). An address that does not connect is not tried again
until GetInfo names another.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc

from gateway.lanes import Lane, carry_trace, rpc_error
from infra import lane_wire as wire
from tandem.v1 import common_pb2

log = logging.getLogger("tandem.gateway")
CONNECT_TIMEOUT_S = 5.0


class LocalLane(Lane):
    """`await lane(request, timeout=s)` -> the response, on the service's local lane or else its gRPC stream."""

    def __init__(self, open_stream, unary, name: str, busy_poll: bool, get_info, method: str, response_cls):
        super().__init__(open_stream, unary, name, busy_poll)
        self.get_info, self.method, self.response_cls = get_info, method, response_cls
        self.sock: socket.socket | None = None
        self.unreachable = ""          # the lane GetInfo named that did not connect
        self.lane = ""                 # the lane connected to (a draft's: where the target sends Proposes ahead)
        self.local_calls = 0

    async def begin(self, request, *, timeout: float | None = None) -> asyncio.Future:
        await self._lock.acquire()
        try:
            if self.sock is not None and wire.peer_closed(self.sock):   # the service went away since its last answer
                self._drop()
            if self.sock is None:
                self.sock = await self._connect()
            if self.sock is None:
                self._lock.release()
                return await super().begin(request, timeout=timeout)
            carry_trace(request)
            data = wire.frame(wire.REQUEST, request.SerializeToString())
            self.written_at = time.perf_counter()     # before the send: the service may have it before it returns
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except grpc.aio.AioRpcError:             # GetInfo failed: the service is away, as a stream would find it
            self._lock.release()
            raise
        except OSError as e:
            self._drop()
            self._lock.release()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.name} (local lane): {e}") from None
        except BaseException:                    # cancelled by the caller
            self._drop()
            self._lock.release()
            raise
        self.local_calls += 1
        return asyncio.ensure_future(self._answer_local(timeout))

    async def _answer_local(self, timeout: float | None):
        end = time.perf_counter() + (timeout if timeout is not None else float("inf"))
        try:
            n, kind = wire.HEADER.unpack(await self._recv(wire.HEADER.size, end))
            payload = await self._recv(n, end) if n else b""
        except asyncio.TimeoutError:
            self._drop()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: no answer within {timeout:.3g} s") from None
        except OSError as e:                     # the service went away (EOF: ConnectionError below)
            self._drop()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.name} (local lane): {e or type(e).__name__}") from None
        except BaseException:                    # cancelled by the caller
            self._drop()
            raise
        finally:
            self._lock.release()
        self.read_at = time.perf_counter()
        if kind == wire.ERROR:
            code, details = wire.parse_error(payload)
            raise rpc_error(getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN), details)
        return self.response_cls.FromString(payload)

    async def _recv(self, n: int, end: float) -> bytes:
        """n bytes of the answer by `end` (asyncio.TimeoutError past it; ConnectionError: the service closed).
        busy_poll: the loop keeps turning without sleeping in its poll, as Lane._read."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        loop = asyncio.get_running_loop()
        while got < n:
            if self.busy_poll:
                try:
                    k = self.sock.recv_into(view[got:])
                except BlockingIOError:
                    if time.perf_counter() > end:
                        raise asyncio.TimeoutError from None
                    await asyncio.sleep(0)
                    continue
            else:
                k = await asyncio.wait_for(loop.sock_recv_into(self.sock, view[got:]),
                                           None if end == float("inf") else max(0.0, end - time.perf_counter()))
            if k == 0:
                raise ConnectionError("the service closed the lane")
            got += k
        return bytes(buf)

    async def _connect(self) -> socket.socket | None:
        """The service's lane, connected and greeted; None: it offers none or this gateway cannot reach it."""
        info = await self.get_info(common_pb2.InfoRequest(), timeout=CONNECT_TIMEOUT_S)
        name = info.local_lane
        if not name or name == self.unreachable:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, wire.address(name)), CONNECT_TIMEOUT_S)
            await loop.sock_sendall(sock, wire.frame(wire.HELLO, self.method.encode()))
            head = await asyncio.wait_for(loop.sock_recv(sock, wire.HEADER.size), CONNECT_TIMEOUT_S)
            n, kind = wire.HEADER.unpack(head) if len(head) == wire.HEADER.size else (0, 0)
            if kind != wire.RESPONSE or n:
                raise ConnectionError(f"the lane refused {self.method}")
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            self.unreachable = name
            log.info("%s: local lane %s not reachable from here (%s); the gRPC stream is used",
                     self.name, name, e or type(e).__name__)
            return None
        log.info("%s: round calls on the local lane %s", self.name, name)
        self.lane = name
        return sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock, self.lane = None, ""

    def close(self) -> None:
        self._drop()
        super().close()
