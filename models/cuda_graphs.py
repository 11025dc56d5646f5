"""CUDA graphs of a model's forward (target verify / decode steps, the draft's MTP steps).

A graph is captured per bucket (B_pad requests, N_pad tokens): B_pad the next of BATCH_BUCKETS >= B,
N_pad the next power of two >= N; at start for every bucket up to a batch size (`enable(warmup_batch=)`,
as the services do), else on a bucket's first use. Every tensor the forward reads is a static
buffer of that shape; each replay rewrites the real rows in place and points the padding at
  - a padding request (index >= B) with context length 0 (its attention output is zero), and
  - one scratch cache slot that no request owns (the padding tokens' K/V writes land there).
Rows past N of the output are garbage and never returned.

Requires the graph-safe kernels (Triton MLA attention, fused MoE): no host read of a tensor value
inside the forward. The attention backend is forced to Triton inside graphs (FlashInfer plans on the
host per step); steps too large for any bucket run eagerly. One process, tp = 1 (collectives in
graphs are not wired here).
"""
from __future__ import annotations

import logging
import time

import torch

from models.kv_cache import AttentionBatch, PagedKVCache

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
        self.max_blocks = -(-max_model_len // cache.block_size) + 1            # fixed table width
        self.token_buckets = tuple(1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens)
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None
        cache.allocate(PAD_REQUEST)                      # one block held for the padding tokens' writes
        cache.extend(PAD_REQUEST, 1)
        self.scratch_slot = cache._tables[PAD_REQUEST][0] * cache.block_size
        self.reserved_blocks = len(cache._tables[PAD_REQUEST])   # never a request's (GetInfo leaves it out)
        self.replays = self.eager = 0

    def bucket(self, batch: AttentionBatch) -> tuple[int, int] | None:
        B, N = len(batch.query_lens), batch.num_tokens
        bp, n_pad = _bucket(B, BATCH_BUCKETS), _bucket(N, self.token_buckets)
        if bp is None or n_pad is None or batch.block_tables.shape[1] > self.max_blocks:
            return None
        return bp, max(n_pad, bp)                        # every padding request is given >= 0 tokens

    def __call__(self, tokens: torch.Tensor, *args, **kw):
        rows, batch = args[:self.extra_rows], args[self.extra_rows]          # then the cache
        key = self.bucket(batch)
        if key is None:
            self.eager += 1
            return self.fn(tokens, *args, **kw)
        key = key + tuple(sorted(kw.items()))
        if key not in self.graphs:
            self.graphs[key] = self._capture(key[0], key[1], kw)
        graph, static, out = self.graphs[key]
        self._fill(static, tokens, rows, batch)
        graph.replay()
        self.replays += 1
        return out[: batch.num_tokens]

    def warmup(self, max_batch: int = 64, **kw) -> int:
        """Capture every (batch bucket <= max_batch, token bucket >= it) now, so that no request waits on a
        Triton compile or a capture later (a first Propose that compiles can outlast its deadline)."""
        n = 0
        for bp in (b for b in BATCH_BUCKETS if b <= max_batch):
            for tokens in (t for t in self.token_buckets if t >= bp):
                key = (bp, tokens) + tuple(sorted(kw.items()))
                if key not in self.graphs:
                    self.graphs[key] = self._capture(bp, tokens, kw)
                    n += 1
        return n

    # --- static buffers ------------------------------------------------------------------------
    def _static(self, bp: int, n: int) -> dict:
        dev = self.cache.device
        s = {"tokens": torch.zeros(n, dtype=torch.long, device=dev),
             "positions": torch.zeros(n, dtype=torch.long, device=dev),
             "slot_mapping": torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev),
             "token_request": torch.full((n,), bp - 1, dtype=torch.int32, device=dev),
             "context_lens": torch.zeros(bp, dtype=torch.int32, device=dev),
             "query_start": torch.zeros(bp + 1, dtype=torch.int32, device=dev),
             "block_tables": torch.zeros(bp, self.max_blocks, dtype=torch.int32, device=dev),
             "rows": [torch.zeros(n, self.hidden_size, dtype=self.dtype, device=dev)
                      for _ in range(self.extra_rows)]}
        s["batch"] = AttentionBatch(
            positions=s["positions"], slot_mapping=s["slot_mapping"], token_request=s["token_request"],
            context_lens=s["context_lens"], query_start=s["query_start"], block_tables=s["block_tables"],
            query_lens=[n // bp] * bp, request_ids=[f"\0pad{i}" for i in range(bp)],
            block_size=self.cache.block_size, attention_backend="triton")
        return s

    def _fill(self, s: dict, tokens, rows, batch: AttentionBatch) -> None:
        # real rows first; padding: request bp - 1 (context 0, when B < bp) or beyond N_real
        N, B, mb = batch.num_tokens, len(batch.query_lens), batch.block_tables.shape[1]
        s["tokens"][:N].copy_(tokens)
        s["positions"][:N].copy_(batch.positions)
        s["positions"][N:].zero_()
        s["slot_mapping"][:N].copy_(batch.slot_mapping)
        s["slot_mapping"][N:].fill_(self.scratch_slot)
        s["token_request"][:N].copy_(batch.token_request)
        s["token_request"][N:].fill_(s["context_lens"].shape[0] - 1)          # request bp - 1
        s["context_lens"].zero_()
        s["context_lens"][:B].copy_(batch.context_lens)
        s["query_start"][: B + 1].copy_(batch.query_start)
        s["query_start"][B + 1:].fill_(N)
        s["block_tables"][:B, :mb].copy_(batch.block_tables)
        for buf, r in zip(s["rows"], rows):
            buf[:N].copy_(r)
        # with B == bp the padding tokens borrow request bp - 1: at position 0 they read its key 0 only
        # and write the scratch slot, so its cache is untouched

    def _capture(self, bp: int, n: int, kw: dict):
        s = self._static(bp, n)
        args = (*s["rows"], s["batch"], self.cache)
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):                           # warm-up: Triton compiles, allocator settles
                self.fn(s["tokens"], *args, **kw)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # the engine's own stream: torch.cuda.graph's default capture stream is one per process, made on the
        # GPU that captured first, and would move a second engine's capture (draft on cuda:1) to that GPU
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                      capture_error_mode="thread_local"):
            out = self.fn(s["tokens"], *args, **kw)
        self.pool = graph.pool()
        log.debug("captured CUDA graph: %d requests, %d tokens %s", bp, n, kw or "")
        return graph, s, out


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
        log.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t0)
    engine.forward = graphed
