"""uvicorn serving the REST app (gateway/http.py) in the gateway's own event loop, on a socket bound
up front so that a busy port fails at start, by name; the gateway, not uvicorn, owns SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from gateway.core import Gateway
from gateway.http import build_app
from gateway.metrics import GatewayMetrics


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):          # the gateway owns SIGINT/SIGTERM
        yield


class HttpServer:
    """uvicorn serving the app on a socket bound up front (a busy port fails at start, by name)."""

    def __init__(self, gw: Gateway, metrics: GatewayMetrics, loop_task, api_key: str, tls=None):
        self.app = build_app(gw, metrics, loop_task, api_key)
        https = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key} if tls is not None and tls.cert else {}
        self.server = _Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                             **https))
        self.sock: socket.socket | None = None

    def bind(self, host: str, port: int) -> int:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise SystemExit(f"gateway: cannot bind the HTTP port {host}:{port} ({e.strerror}); "
                             "choose another with --http-port") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        return sock.getsockname()[1]

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    async def shutdown(self) -> None:
        self.server.should_exit = True
        await asyncio.sleep(0)
