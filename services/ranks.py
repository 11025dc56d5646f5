"""A service as `tp` rank processes in one torch.distributed group (gloo on CPU, NCCL on GPU).

Rank 0 hosts the gRPC server. Every engine call is broadcast to the other ranks, which replay it
on their own shards; decisions that depend on sampling (first tokens, accepted counts, draft
tokens) are broadcast from rank 0 inside the engines (`ParallelState.decide`), so every rank's
cache bookkeeping stays identical. Workers exit when rank 0 goes away.
"""
from __future__ import annotations

import contextlib

import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from models.parallel import ParallelState
from services.bridge.rows import ServiceError
from services.config import ServiceConfig
from services.identity import model_identity

log = logging.getLogger("tandem.ranks")


def start_workers(role: str, argv: list[str], cfg: ServiceConfig) -> list[subprocess.Popen]:
    """Rank 0 starts ranks 1..tp-1 as `tandem ROLE <same flags> --rank i`."""
    return [subprocess.Popen([sys.executable, "-m", "tandem", role, *argv, "--rank", str(r)])
            for r in range(1, cfg.tp)]


def init_group(cfg: ServiceConfig) -> ParallelState:
    if cfg.tp == 1:
        return ParallelState(ep_size=cfg.ep)
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    from services.bridge.channel import tcp_store        # rank 0's store listens on the dist host only
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

    def call(self, method: str, *args):
        """Rank 0: run engine.method(*args) on every rank; return rank 0's result.

        With tp > 1 any error other than a ServiceError (a rank died: gloo/NCCL raise at the next
        collective; or a bug, after which the ranks' caches differ) leaves the group unusable: this
        call and every later one answer UNAVAILABLE, and the process exits shortly after so that
        `tandem serve` (or the orchestrator) restarts the whole service."""
        if self.broken:
            raise ServiceError("UNAVAILABLE", self.broken)
        if self.ps.tp_size == 1:
            with on_device(self.engine.cache.device):
                return getattr(self.engine, method)(*args)
        try:
            dist.broadcast_object_list([(method, _cpu(args))], src=0)
            with on_device(self.engine.cache.device):
                return getattr(self.engine, method)(*args)
        except ServiceError:
            raise
        except Exception as e:
            self._break(f"{type(e).__name__}: {str(e)[:300]}")
            raise ServiceError("UNAVAILABLE", self.broken) from None

    def _break(self, why: str) -> None:
        self.broken = f"the rank group of this service broke ({why}); restarting"
        log.critical("%s; exiting with code %d in 0.5 s", self.broken, EXIT_GROUP_BROKEN)
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
                    getattr(self.engine, method)(*args)
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
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def service_info(cfg: ServiceConfig, engine, running: int):
    """The InfoResponse both services answer GetInfo with (the gateway checks they agree)."""
    from services.bridge.rows import CONTRACT_VERSION
    from tandem.v1 import target_pb2
    mc = engine.model.cfg
    reserved = getattr(engine.forward, "reserved_blocks", 0)     # CUDA graphs' scratch block: no request's
    return target_pb2.InfoResponse(
        model=cfg.model, vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        eos_token_ids=list(mc.eos_token_ids), max_model_len=engine.max_model_len,
        kv_blocks_total=engine.cache.num_blocks - reserved, kv_blocks_free=engine.cache.num_free_blocks,
        running_requests=running, contract_version=CONTRACT_VERSION,
        num_nextn_predict_layers=mc.num_nextn_predict_layers, model_identity=model_identity(cfg.model),
        index_topk=mc.index_topk or 0, index_scoring=engine.cache.index_scoring or "")


def hello(cfg: ServiceConfig) -> dict:
    """What target and draft exchange when their bridge connects (and report in GetInfo)."""
    from services.bridge.rows import CONTRACT_VERSION
    return {"model_identity": model_identity(cfg.model), "contract_version": CONTRACT_VERSION}


class ServicerBase:
    """Release and GetInfo, answered alike by the target and the draft. A subclass sets cfg, group,
    engine and lock, and says how many requests it is running."""

    def running(self) -> int:
        raise NotImplementedError

    def Release(self, request, context):
        from tandem import grpc_server
        from tandem.v1 import target_pb2
        try:
            with self.lock:
                return target_pb2.ReleaseResponse(released=self.group.call("release", list(request.request_ids)))
        except ServiceError as e:             # the rank group broke: UNAVAILABLE, not a traceback
            grpc_server.abort(context, e.code, str(e))

    def GetInfo(self, request, context):
        from tandem import grpc_server
        if self.group.broken:                 # exiting to be restarted: not back for a gateway's check
            grpc_server.abort(context, "UNAVAILABLE", self.group.broken)
        return service_info(self.cfg, self.engine, self.running())


def run_service(role: str, argv: list[str], description: str, model_cls, engine_cls, make_servicer,
                add_servicer, service_name: str) -> int:
    """Start one target or draft process: rank 0 serves gRPC, the others replay its engine calls."""
    from models.kv_cache import index_scoring_for
    from models.presets import load_any
    from models.runner import new_cache
    from services.bridge.channel import RowChannel
    from services.config import parse, setup_torch
    from tandem import grpc_server
    cfg = parse(role, argv, description)
    workers = start_workers(role, argv, cfg) if cfg.rank == 0 else []
    try:
        setup_torch(cfg)
        ps = init_group(cfg)
        try:
            model = load_any(model_cls, cfg.model, ps=ps, dtype=cfg.torch_dtype, device=cfg.rank_device)
        except ValueError as e:                    # layout errors: heads/experts not divisible, ...
            raise SystemExit(f"tandem {role}: {e}") from None
        mc = model.cfg
        cache = new_cache(model, cfg.num_blocks, cfg.block_size, index_scoring_for(cfg.index_scoring, cfg.device))
        if mc.sparse_attention:
            log.info("%s: DeepSeek sparse attention: index_topk %d, %d index heads of %d, %s scoring", role,
                     mc.index_topk, mc.index_n_heads, mc.index_head_dim, cache.index_scoring)
        max_len = min(cfg.max_model_len, mc.max_position_embeddings)
        engine = engine_cls(model, cache, max_len)
        if cfg.device.startswith("cuda") and cfg.tp == 1 and not cfg.enforce_eager:
            from models import cuda_graphs
            cuda_graphs.enable(engine, extra_rows=1 if role == "draft" else 0, warmup_batch=cfg.cuda_graph_max_batch)
        group = RankGroup(engine, ps)
        if cfg.rank > 0:
            group.serve_worker()
            return 0
        backend = cfg.bridge_backend
        log.info("%s: model identity %s (%s)", role, model_identity(cfg.model), cfg.model)
        channel = RowChannel(cfg.bridge_addr, "sender" if role == "target" else "receiver", backend,
                             cfg.rank_device, hello=hello(cfg), ipc_bytes=cfg.bridge_ipc_mib << 20) if backend else None
        servicer = make_servicer(cfg, group, channel)
        try:
            from tandem import tracing
            tracing.setup(f"tandem-{role}", cfg.otlp_endpoint)
            grpc_server.serve(lambda s: add_servicer(servicer, s), [service_name], cfg.host, cfg.port,
                              max_bytes=cfg.max_message_bytes, tls=cfg.tls)
        finally:
            group.close()
    finally:
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
    return 0
