"""Rendezvous stores: where the ranks of one service (services/ranks.py) and the two ends of the hidden-row
bridge (services/bridge/channel.py) find each other."""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


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
