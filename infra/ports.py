"""Free TCP ports for local clusters (tandem bench's `tandem serve`, the tests' clusters)."""
from __future__ import annotations

import random
import socket

PORT_RANGE = (20000, 29000)        # below the ephemeral range (32768-60999) and the defaults (29650-29670)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together, so they differ), below the ephemeral range:
    before a service binds one, the OS may give an ephemeral port to any socket on port 0 (gloo, gRPC clients)."""
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(*PORT_RANGE)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port(flag: str, port: int, prog: str, least: int = 1) -> None:
    """A TCP port a flag names: SystemExit naming it outside least..65535 (a negative one wrapped around to
    another; least 0: the system picks a free one)."""
    if not least <= port <= 65535:
        raise SystemExit(f"{prog}: {flag} must be a TCP port in {least}..65535, got {port}")


def check_addr_port(flag: str, addr: str, prog: str) -> None:
    """host:port of a flag: its port as check_port (env:// and the like pass)."""
    head, _, tail = addr.rpartition(":")
    if head and tail.lstrip("-").isdigit():
        check_port(flag, int(tail), prog)
