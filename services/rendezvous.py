"""Rendezvous stores: where the ranks of one service (services/ranks.py) and the two ends of the hidden-row
bridge (services/bridge/channel.py) find each other.

A rank group may span hosts. Rank 0 hosts its TCP store at `--dist-addr HOST:PORT` (an address of its own that
the other hosts reach); ranks it does not start itself (`--local-ranks N`: it starts ranks 1..N-1 on its host)
run `tandem ROLE <the same flags> --rank I` on their hosts. Or, as torch.distributed's env:// and its launchers
(torchrun, a Kubernetes StatefulSet, deploy/) do it: `--dist-addr env://` takes MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE (= --tp) from the environment, each rank launched on its own.
"""
from __future__ import annotations

import os
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


ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def resolve(dist_addr: str, tp: int, rank: int, local_ranks: int) -> tuple[str, int, int, int]:
    """(dist_addr, tp, rank, local_ranks) with env:// read from the environment (every rank launched on its
    own: local_ranks 1). ValueError names what is missing or contradicts."""
    if dist_addr != "env://":
        return dist_addr, tp, rank, local_ranks
    missing = [k for k in ENV_KEYS if not os.environ.get(k)]
    if missing:
        raise ValueError(f"--dist-addr env:// needs {', '.join(missing)} in the environment")
    world = int(os.environ["WORLD_SIZE"])
    if tp not in (1, world):
        raise ValueError(f"--tp {tp} but WORLD_SIZE={world}")
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", world, int(os.environ["RANK"]), 1
