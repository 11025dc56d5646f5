"""A service as `tp` rank processes in one torch.distributed group (gloo on CPU, NCCL on GPU).

Rank 0 hosts the gRPC server. Every engine call is broadcast to the other ranks, which replay it
on their own shards; decisions that depend on sampling (first tokens, accepted counts, draft
tokens) are broadcast from rank 0 inside the engines (`ParallelState.decide`), so every rank's
cache bookkeeping stays identical. Workers exit when rank 0 goes away.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from infra.errors import ServiceError
from models.parallel import ParallelState
from services.config import ServiceConfig
from services.rendezvous import tcp_store

log = logging.getLogger("tandem.ranks")
R = TypeVar("R")


def start_workers(role: str, argv: list[str], cfg: ServiceConfig) -> list[subprocess.Popen]:
    """Rank 0 starts ranks 1..N-1 of its host (N: --local-ranks, default all of --tp) as
    `tandem ROLE <same flags> --rank i`; other hosts start the rest (services/rendezvous.py)."""
    return [subprocess.Popen([sys.executable, "-m", "tandem", role, *argv, "--rank", str(r)])
            for r in range(1, cfg.local_ranks or cfg.tp)]


def init_group(cfg: ServiceConfig) -> ParallelState:
    if cfg.tp == 1:
        return ParallelState(ep_size=cfg.ep)
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    host, port = cfg.dist_addr.rsplit(":", 1)
    store = tcp_store(host, int(port), cfg.tp, cfg.rank == 0, timedelta(seconds=600))
    dist.init_process_group(backend, store=store, rank=cfg.rank, world_size=cfg.tp, timeout=timedelta(seconds=600))
    log.info("%s rank %d/%d joined (%s)", cfg.role, cfg.rank, cfg.tp, backend)
    return ParallelState(tp_rank=cfg.rank, tp_size=cfg.tp, ep_size=cfg.ep,
                         sequence_parallel=cfg.sequence_parallel, tp_group=dist.group.WORLD)


EXIT_GROUP_BROKEN = 75        # rank 0's exit status when its rank group broke (a supervisor restarts it)


class RankGroup:
    def __init__(self, engine, ps: ParallelState):
        self.engine, self.ps = engine, ps
        self.broken: str | None = None

    def call(self, method: Callable[..., R], *args) -> R:
        """Rank 0: run method(engine, *args) on every rank (method: an engine method, e.g.
        TargetEngine.verify, sent to the other ranks by its qualified name); return rank 0's result.

        With tp > 1 any error other than a ServiceError (a rank died: gloo/NCCL raise at the next
        collective; or a bug, after which the ranks' caches differ) leaves the group unusable: this
        call and every later one answer UNAVAILABLE, and the process exits shortly after so that
        `tandem serve` (or the orchestrator) restarts the whole service."""
        if self.broken:
            raise ServiceError("UNAVAILABLE", self.broken)
        if self.ps.tp_size == 1:
            with on_device(self.engine.cache.device):
                return method(self.engine, *args)
        try:
            dist.broadcast_object_list([(method, _cpu(args))], src=0)
            with on_device(self.engine.cache.device):
                return method(self.engine, *args)
        except ServiceError:
            raise
        except Exception as e:
            self._break(f"{type(e).__name__}: {str(e)[:300]}")
            raise ServiceError("UNAVAILABLE", self.broken) from None

    def _break(self, why: str) -> None:
        self.broken = f"the rank group of this service broke ({why}); restarting"
        log.critical("%s; exiting with code %d in 0.5 s", self.broken, EXIT_GROUP_BROKEN)
        # a backstop that needs no GIL, armed first: were the timer never to run or even start (seen once in a loaded
        # test run: the process stayed, said UNAVAILABLE, and nothing restarted it), every thread's stack goes to the
        # log and it exits 1
        faulthandler.dump_traceback_later(10.0, exit=True)
        threading.Timer(0.5, os._exit, (EXIT_GROUP_BROKEN,)).start()   # after this answer went out

    def serve_worker(self) -> None:
        """Ranks > 0: replay rank 0's calls until it closes the group or dies."""
        while True:
            msg = [None]
            try:
                dist.broadcast_object_list(msg, src=0)
            except Exception as e:
                log.info("rank %d: rank 0 is gone (%s); exiting", self.ps.tp_rank, type(e).__name__)
                return
            if msg[0] is None:
                return
            method, args = msg[0]
            try:
                with on_device(self.engine.cache.device):
                    method(self.engine, *args)
            except ServiceError:
                pass                       # rank 0 raised the same error and answered the client

    def close(self) -> None:
        """Tell the workers to exit; those already gone (killed with rank 0's process group) need no word."""
        if self.ps.tp_size > 1 and not self.broken:
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception as e:
                log.info("closing the rank group: a worker is already gone (%s)", type(e).__name__)


def on_device(device: torch.device):
    """The engine's GPU as this thread's current device: gRPC worker threads start on cuda:0, and
    Triton launches on the current device (a draft on cuda:1 would pass cuda:1 pointers to cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):                  # a NamedTuple (services/sampling.TopQ)
        return type(x)(*(_cpu(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x
