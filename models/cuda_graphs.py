"""CUDA graphs of a model's forward (target verify / decode steps, the draft's MTP steps).

A graph is captured per bucket (B_pad requests, N_pad tokens): B_pad the next of BATCH_BUCKETS >= B,
N_pad the next power of two >= N; at start for every bucket up to a batch size (`enable(warmup_batch=)`,
as the services do), else on a bucket's first use. Every tensor the forward reads is a static
buffer of that shape (a models.batch.Stage, one per bucket, which the cache lays each step of that shape
out into: one host-to-device copy and two casts, the input ids included); the padding points at
  - a padding request (index >= B) with context length 0 (its attention output is zero), and
  - one scratch cache slot that no request owns (the padding tokens' K/V writes land there).
Rows past N of the output are garbage and never returned.

Requires the graph-safe kernels (Triton MLA attention, fused MoE): no host read of a tensor value
inside the forward. The attention backend is forced to Triton inside graphs (FlashInfer plans on the
host per step); steps too large for any bucket run eagerly. One process, tp = 1 (collectives in
graphs are not wired here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import torch

from kernels.dispatch import PREFILL_MIN_ROWS
from models.batch import Stage, lay_out
from models.kv_cache import PagedKVCache

log = logging.getLogger("tandem.graphs")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PAD_REQUEST = "\0cuda-graph-scratch"


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


class GraphedForward:
    """fn(tokens [N], *rows [N, D], batch, cache) -> [N, D], replayed from CUDA graphs where a bucket fits.

    `fn` is the model call (TargetModel(tokens, batch, cache) or DraftModel(tokens, hidden, batch, cache,
    step)); `extra_rows` is how many [N, D] row inputs it takes after the tokens (draft: 1).
    """

    def __init__(self, fn, cache: PagedKVCache, hidden_size: int, dtype: torch.dtype, max_model_len: int,
                 max_tokens: int = 512, extra_rows: int = 0):
        self.fn, self.cache, self.extra_rows = fn, cache, extra_rows
        self.hidden_size, self.dtype = hidden_size, dtype
        # fixed table width: a request's blocks, at most max_model_len's (+1) and at most the pool's
        self.max_blocks = min(-(-max_model_len // cache.block_size) + 1, cache.num_blocks)
        self.token_buckets = tuple(1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens)
        self.graphs: dict[tuple, tuple] = {}
        self.stages: dict[tuple[int, int], Stage] = {}
        self.pool = None
        cache.allocate(PAD_REQUEST)                      # one block held for the padding tokens' writes
        cache.extend(PAD_REQUEST, 1)
        self.scratch_slot = cache._tables[PAD_REQUEST][0] * cache.block_size
        self.reserved_blocks = len(cache._tables[PAD_REQUEST])   # never a request's (GetInfo leaves it out)
        self.replays = self.eager = 0
        cache.staging = self.stage                       # steps of a bucket's shape are laid out into its buffers

    def bucket(self, B: int, N: int, width: int) -> tuple[int, int] | None:
        bp, n_pad = _bucket(B, BATCH_BUCKETS), _bucket(N, self.token_buckets)
        if bp is None or n_pad is None or width > self.max_blocks:
            return None
        return bp, max(n_pad, bp)                        # every padding request is given >= 0 tokens

    def stage(self, B: int, N: int, width: int) -> Stage | None:
        """The input buffers of the bucket a step of B requests, N tokens and tables `width` wide replays in (the
        cache lays its steps out into them: PagedKVCache.staging), None where it runs eagerly."""
        key = self.bucket(B, N, width)
        if key is None:
            return None
        if key not in self.stages:
            bp, n = key
            rows = [torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.cache.device)
                    for _ in range(self.extra_rows)]
            self.stages[key] = Stage.new(n, bp, self.max_blocks, self.scratch_slot, self.cache.device, rows)
        return self.stages[key]

    def __call__(self, tokens: torch.Tensor, *args, **kw):
        rows, batch = args[:self.extra_rows], args[self.extra_rows]          # then the cache
        stage = self.stage(len(batch.query_lens), batch.num_tokens, batch.block_tables.shape[1])
        if stage is None:
            self.eager += 1
            return self.fn(tokens, *args, **kw)
        key = (stage.b, stage.n) + tuple(sorted(kw.items()))
        if key not in self.graphs:
            self.graphs[key] = self._capture(stage, kw)
        graph, out = self.graphs[key]
        N = batch.num_tokens
        if not stage.holds(batch):                       # laid out elsewhere: lay it out again into the stage
            lay_out(batch.request_ids, batch.host_block_tables.tolist(), batch.host_starts, batch.query_lens,
                    self.cache.block_size, self.cache.device, stage=stage)
        ids = stage.batch().input_ids
        if tokens.data_ptr() != ids.data_ptr():          # ids not laid out with the batch
            ids[:N].copy_(tokens)
        for buf, r in zip(stage.rows, rows):
            buf[:N].copy_(r)
        graph.replay()
        self.replays += 1
        return out[:N]

    def warmup(self, max_batch: int = 64, **kw) -> int:
        """Capture every (batch bucket <= max_batch, token bucket >= it) now, so that no request waits on a
        Triton compile or a capture later (a first Propose that compiles can outlast its deadline)."""
        n = 0
        for bp in (b for b in BATCH_BUCKETS if b <= max_batch):
            for tokens in (t for t in self.token_buckets if t >= bp):
                key = (bp, tokens) + tuple(sorted(kw.items()))
                if key not in self.graphs:
                    self.graphs[key] = self._capture(self.stage(bp, tokens, 1), kw)
                    n += 1
        return n

    def warm_eager(self, shapes, **kw) -> int:
        """Run the forward eagerly once at each (tokens, requests) of `shapes` (steps past the graphs' buckets, over
        scratch requests freed after), so that the kernels of their size classes (the fused MoE's block rows and
        tiles, the attention's key splits) compile now and not in the first step of that class mid-serving, every
        stream waiting 0.3-7 s on the H200 (BENCHMARKS.md, twenty-fourth session). -> the steps run (a shape the pool
        cannot hold is left out)."""
        c, bs, done = self.cache, self.cache.block_size, 0
        for n, b in shapes:
            b = max(b, -(-n // ((self.max_blocks - 1) * bs)))
            lens = [n // b + (j < n % b) for j in range(b)]
            if sum(-(-q // bs) for q in lens) > c.pool.available:
                continue
            ids = [f"\0warm{j}" for j in range(b)]
            for r in ids:
                c.allocate(r)
            try:
                batch = c.prepare(ids, lens, [0] * n)
                rows = [torch.zeros(n, self.hidden_size, dtype=self.dtype, device=c.device) for _ in range(self.extra_rows)]
                with torch.inference_mode():
                    self.fn(batch.input_ids, *rows, batch, c, **kw)
                done += 1
            finally:
                for r in ids:
                    c.release(r)
        return done

    def _capture(self, stage: Stage, kw: dict):
        # the graph reads the stage's buffers: all of the bucket's graphs (the draft's per-step ones) share them
        full = stage.batch()
        batch = dataclasses.replace(full, query_lens=[stage.n // stage.b] * stage.b, attention_backend="triton",
                                    request_ids=[f"\0pad{i}" for i in range(stage.b)], block_size=self.cache.block_size)
        ids, args = full.input_ids, (*stage.rows, batch, self.cache)
        stream = capture_stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):                           # warm-up: Triton compiles, allocator settles
                self.fn(ids, *args, **kw)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # the engine's own stream: torch.cuda.graph's default capture stream is one per process, made on the
        # GPU that captured first, and would move a second engine's capture (draft on cuda:1) to that GPU
        with gc_paused(), torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                                   capture_error_mode="thread_local"):
            out = self.fn(ids, *args, **kw)
        self.pool = graph.pool()
        log.debug("captured CUDA graph: %d requests, %d tokens %s", stage.b, stage.n, kw or "")
        return graph, out


_CAPTURE_STREAMS: dict = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The one stream a device's captures and their eager warm-ups run on (the steps' and the draft's chains). The
    caching allocator (the graphs' shared pool too) reuses a freed block only on the stream it was allocated on: with
    a new stream per capture each capture kept its own memory, unused after it (V2-Lite: ~1 GB more allocated on
    each service, 4.6 GB more reserved on the target and 7.0 GB on the draft; BENCHMARKS.md, forty-third session)."""
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


@contextlib.contextmanager
def gc_paused():
    """No garbage collection while a graph is captured: torch no longer collects before a capture, and a collection
    during one runs finalizers on the capturing thread, where one that calls CUDA (a closed bridge generation's IPC
    mapping, an event, a stream synchronized) invalidates the capture. Collected after it instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def eager_shapes(max_tokens: int) -> list[tuple[int, int]]:
    """(tokens, requests) of the eager steps run at start: from just past the graphs' largest bucket to 8x it, 1.15x
    apart (the fused MoE's size classes), over one request (long contexts: many key splits), three, or requests of
    ~64 tokens (one split); then one step whose requests bring at most PREFILL_MIN_ROWS tokens each, attended as a
    decode step is, outside a graph (a verify with short prompts riding it)."""
    out, n = [], max_tokens + 8
    while n <= 8 * max_tokens + 8:
        out.append((n, (1, 3, max(1, n // 64))[len(out) % 3]))
        n = int(n * 1.15) + 1
    return out + [(max_tokens + 8, -(-(max_tokens + 8) // PREFILL_MIN_ROWS))]


def enable(engine, extra_rows: int = 0, max_tokens: int = 512, warmup_batch: int = 0) -> None:
    """Route a target (extra_rows 0) or draft (1) engine's forward through CUDA graphs; with
    warmup_batch > 0 capture the buckets up to that batch now (the draft: for each of its MTP layers)."""
    m, c = engine.model, engine.cache
    graphed = GraphedForward(m, c, m.cfg.hidden_size, c.ckv.dtype, engine.max_model_len,
                             max_tokens=max_tokens, extra_rows=extra_rows)
    if warmup_batch:
        t0 = time.perf_counter()
        steps = [{"step": i} for i in range(m.num_cache_layers)] if extra_rows else [{}]
        n = sum(graphed.warmup(warmup_batch, **kw) for kw in steps)
        e = sum(graphed.warm_eager(eager_shapes(max_tokens), **kw) for kw in steps)
        log.info("captured %d CUDA graphs and ran %d eager steps in %.1f s", n, e, time.perf_counter() - t0)
    engine.forward = graphed
