"""Building and starting a service: the one engine builder (model, KV cache, engine, CUDA graphs) that the
services and every benchmark use, and a target or draft process's life (rank group, bridge, gRPC server)."""
from __future__ import annotations

import logging
import subprocess
import time

import torch

from infra import grpc_server, tracing
from models.kv_cache import index_scoring_for
from models.parallel import ParallelState
from models.presets import load_any
from models.runner import new_cache
from services.bridge.channel import RowChannel
from services.config import parse, setup_torch
from services.identity import model_identity
from services.ranks import RankGroup, init_group, on_device, start_workers
from services.servicer import hello

log = logging.getLogger("tandem.launch")


def context_limit(asked: int, model_max: int, cache_tokens: int, what: str = "tandem") -> int:
    """The context one request may use: the asked max_model_len (0: the model's max_position_embeddings), never
    more than the model's positions or the whole KV cache."""
    limit = min(asked or model_max, model_max, cache_tokens)
    if asked and limit < asked or not asked and limit < model_max:
        log.warning("%s: max_model_len %d (asked %s; the model has %d positions, the KV cache %d tokens)",
                    what, limit, asked or "the model's", model_max, cache_tokens)
    return limit


def build_engine(engine_cls, model_cls, model: str, device: str, dtype: torch.dtype, ps: ParallelState | None = None,
                 num_blocks: int = 2048, block_size: int = 16, max_model_len: int = 0, index_scoring: str = "auto",
                 graphs: bool = True, graph_batch: int = 64, what: str = "tandem", prefix_cache: bool = False,
                 quantization: str = "auto"):
    """Model -> KV cache -> engine -> CUDA graphs, as every service and benchmark builds them. model: a
    checkpoint directory or a random preset id; graphs: captured on CUDA (the draft's for each MTP layer)
    up to graph_batch requests now (0: lazily); prefix_cache: prefix caching on (models/prefix_cache.py);
    quantization: models/config.QUANTIZATIONS."""
    try:
        m = load_any(model_cls, model, ps=ps, dtype=dtype, device=device, quantization=quantization)
    except ValueError as e:                    # layout errors: heads/experts not divisible, ...
        raise SystemExit(f"{what}: {e}") from None
    mc = m.cfg
    cache = new_cache(m, num_blocks, block_size, index_scoring_for(index_scoring, device))
    if mc.sparse_attention:
        log.info("%s: DeepSeek sparse attention: index_topk %d, %d index heads of %d, %s scoring", what,
                 mc.index_topk, mc.index_n_heads, mc.index_head_dim, cache.index_scoring)
    engine = engine_cls(m, cache, context_limit(max_model_len, mc.max_position_embeddings, num_blocks * block_size,
                                                what))
    if prefix_cache:                           # the salt: what else decides a block's values
        ident = f"{model_identity(model)}|{dtype}|tp={ps.tp_size if ps else 1}"
        rows = f"|rows of the target {model_identity(model)}" if engine_cls.prefix_shift else ""
        cache.enable_prefix_cache(f"{engine_cls.__name__}|{ident}{rows}", engine_cls.prefix_shift)
    if graphs and str(device).startswith("cuda"):
        from models import cuda_graphs
        with on_device(torch.device(device)):      # capture and Triton launches on the engine's own GPU
            t0, mib = time.perf_counter(), lambda: (torch.cuda.memory_allocated() / 2**20,
                                                    torch.cuda.memory_reserved() / 2**20)
            a0, _ = mib()
            cuda_graphs.enable(engine, extra_rows=engine_cls.graph_row_inputs, warmup_batch=graph_batch)
            a1, _ = mib()
            engine.graphs_enabled(graph_batch)
            a2, r2 = mib()
            log.info("%s: CUDA graphs ready in %.1f s; MiB allocated: steps %+.0f%s; %.0f MiB reserved in all", what,
                     time.perf_counter() - t0, a1 - a0, f", {len(engine.chain.compiled)} chains {a2 - a1:+.0f}"
                     if getattr(engine, "chain", None) else "", r2)
    return engine


def run_service(role: str, argv: list[str], description: str, model_cls, engine_cls, make_servicer,
                add_servicer, service_name: str) -> int:
    """Start one target or draft process: rank 0 serves gRPC, the others replay its engine calls."""
    cfg = parse(role, argv, description)
    workers = start_workers(role, argv, cfg) if cfg.rank == 0 else []
    try:
        setup_torch(cfg)
        ps = init_group(cfg)
        engine = build_engine(engine_cls, model_cls, cfg.model, cfg.rank_device, cfg.torch_dtype, ps=ps,
                              num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                              index_scoring=cfg.index_scoring, graphs=cfg.tp == 1 and not cfg.enforce_eager,
                              graph_batch=cfg.cuda_graph_max_batch, what=f"tandem {role}",
                              prefix_cache=not cfg.no_prefix_cache, quantization=cfg.quantization)
        # loaded: from here a GPU service's host work (a step's layout, row bookkeeping) is small, and a pool of
        # idle threads made one parallel op of it wait milliseconds for them to wake (BENCHMARKS.md "The hops of
        # a call": 6-8 ms a batch-32 Propose); a CPU service computes on these threads too (setup_torch)
        torch.set_num_threads(cfg.threads)
        if role == "draft":
            engine.q_mass = cfg.draft_q_mass       # on every rank: they draw alike (rank 0 decides the tokens)
        group = RankGroup(engine, ps)
        if cfg.rank > 0:
            group.serve_worker()
            return 0
        backend = cfg.bridge_backend
        log.info("%s: model identity %s (%s)", role, model_identity(cfg.model), cfg.model)
        channel = RowChannel(cfg.bridge_addr, "sender" if role == "target" else "receiver", backend,
                             cfg.rank_device, hello=hello(cfg), ipc_bytes=cfg.bridge_ipc_mib << 20) if backend else None
        servicer = make_servicer(cfg, group, channel)
        lane = None if cfg.no_local_lane or cfg.tls.cert else servicer.open_lane(cfg.lane_spin_s, cfg.max_message_bytes)
        try:
            tracing.setup(f"tandem-{role}", cfg.otlp_endpoint)
            grpc_server.serve(lambda s: add_servicer(servicer, s), [service_name], cfg.host, cfg.port,
                              max_bytes=cfg.max_message_bytes, tls=cfg.tls)
        finally:
            if lane is not None:
                lane.close()
            if channel is not None:
                channel.close()                    # its threads leave their store calls before the interpreter exits
            group.close()
    finally:
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
    return 0
