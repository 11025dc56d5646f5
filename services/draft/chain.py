"""The draft's chained MTP steps as one CUDA graph, with the token choice on the device (issue 14).

After step 0 (the committed rows, models/cuda_graphs.py) a round proposes k tokens per request:
choose token 1 from step 0's hidden, run the MTP layer on (token 1, that hidden), choose token 2, ...
The loop in DraftEngine does this with a host round trip per token (logits -> argmax -> .cpu() ->
the next step's layout -> replay). Here the whole chain is one replay:

    h_0 = hidden of step 0                      # [B, D]
    for s in 0 .. k_max - 1:
        t_s = argmax(lm_head(h_s))              # greedy: token s + 1 of the round, on the device
        if s < k_max - 1: h_{s+1} = mtp(t_s, h_s, step s + 1)

Every step's cache layout is known before the replay (one new position per live request per step),
so the host extends the cache for all steps at once and copies one packed layout to the device; the
replay's only host sync is the final [B, k_max] token copy. Requests with fewer drafts than k_max are
padding in the later steps: position 0, context 0, their write lands on the scratch slot, their rows
are never read. Without CUDA (CPU tests) the same body runs eagerly on the same buffers.

A round with sampled requests runs the sampled variant of the graph: each step's q = the request's
temperature / top-k / top-p distribution and its token a draw from q with the request's keyed noise
(noise.py: the same draws as the loop's); the [B, k_max, V] q come back with the tokens, or with q_mass < 1
each q cut to its top tokens of that mass (noise.top_mass: the draw is from the cut q) and only those
[B, k_max, w] ids and probabilities come back (with the whole q of a round where some row was too flat to cut).

An early pass (early.py) whose requests all draft runs its step 0 in the same graph (plan's `early`): the Verify's
acceptance frame F (copied into a fixed buffer) gives step 0's tokens and each request's accepted count a, and the
chain starts from step 0's row a, so that once the frame reaches the host the pass is two copies and one replay:

    ids = F[tok_r, tok_c]                       # [n]: row i of a request pairs with the token emitted at i
    h = mtp(ids, rows, step 0)                  # [n, D], in the step's bucket (models/cuda_graphs.py's stage)
    a = min(F[frame_rows, 0], k)                # [bp]
    h_0 = h[offsets + a]; positions from starts + a
"""
from __future__ import annotations

import dataclasses

import torch

from models.cuda_graphs import BATCH_BUCKETS, PAD_REQUEST, _bucket, capture_stream, gc_paused
from kernels.dispatch import argmax_rows, sampling_probs
from infra.errors import KV_CACHE_FULL
from models.batch import TwinBuffer, table_rows_end
from models.kv_cache import AttentionBatch, CacheFullError, PagedKVCache
from infra.defaults import DRAFT_Q_WIDTH
from kernels.noise import choose, draw_keys, top_mass
from services.bridge.rows import expect_rows
from services.sampling import Sampling

SAMPLING_PARTS = ("temp", "top_k", "top_p", "seeds", "draws")     # a sampled chain's per-row buffers
EARLY_PARTS = ("frame_rows", "off", "most", "tok_r", "tok_c")     # an early plan's (its early[1:], in order)
MAX_EARLY_GRAPHS = 64      # early graphs kept (a step 0 and a chain each); past it, new shapes run step 0 apart


class DraftChain:
    """`run(ids, hidden [B, D], ks, sampled, q_mass)` -> (drafts per request, ks[b] tokens each; q on the host:
    None, [B, k_max, V], or with q_mass < 1 top_mass's (ids, probs [B, k_max, w], whole [B, k_max], and q
    [B, k_max, V] where some row is whole, else None)), extending the cache by ks[b] - 1
    positions per request; None when the round does not fit (the caller runs its loop). sampled: None (all
    greedy) or per request (Sampling, noise seed, first draw)."""

    def __init__(self, model, cache: PagedKVCache, max_model_len: int, max_k: int, graphs: bool):
        self.model, self.cache, self.max_k, self.graphs = model, cache, max_k, graphs
        self.max_blocks = -(-max_model_len // cache.block_size) + 1
        if PAD_REQUEST not in cache._tables:              # shared with GraphedForward when both exist
            cache.allocate(PAD_REQUEST)
            cache.extend(PAD_REQUEST, 1)
        self.scratch_slot = cache._tables[PAD_REQUEST][0] * cache.block_size
        self.dtype = model.lm_head.weight.dtype
        self.compiled: dict[tuple, tuple] = {}
        self.pool = None
        self.frame = None                  # early graphs: the acceptance frame [BATCH_BUCKETS[-1], 2 + max_k]
        self.runs = self.replays = self.early_runs = 0   # rounds drafted here; replayed graphs; with step 0 in them

    def run(self, ids: list[str], hidden: torch.Tensor, ks: list[int],
            sampled: list[tuple[Sampling, int, int]] | None = None, q_mass: float = 1.0,
            acc: torch.Tensor | None = None, starts: list[int] | None = None, then=None):
        """acc, starts (an early pass, services/draft/early.py): step 1 of request b writes position starts[b] +
        acc[b], acc [B] on the device (the accepted counts, not yet known on the host; the cache holds the most
        positions they could need); then(): host work to run once the replay is queued, before its one sync."""
        plan = self.plan(ids, ks, sampled, q_mass, starts)
        return None if plan is None else self.go(plan, hidden, acc, then)

    def plan(self, ids: list[str], ks: list[int], sampled: list[tuple[Sampling, int, int]] | None = None,
             q_mass: float = 1.0, starts: list[int] | None = None, early: tuple | None = None) -> tuple | None:
        """What of a round's chain needs neither its hidden rows nor the accepted counts, done now (an early pass
        does it before the acceptance reaches its host): the cache extended by ks[b] - 1 positions a request, the
        graph built, the layout uploaded. -> the plan for go(), None when the round does not fit (nothing done).
        early: (step 0's stage, frame rows [B], row offsets [B], rows - 1 [B], tokens' frame rows and columns [N])
        of an early pass whose step 0 runs in the graph (go() is then given the frame and the rows)."""
        B, k_max = len(ids), max(ks)
        bp = _bucket(B, BATCH_BUCKETS)
        if bp is None or k_max > self.max_k or min(ks) < 1:
            return None
        cache, bs = self.cache, self.cache.block_size
        need = sum(cache.blocks_needed(r, k - 1) for r, k in zip(ids, ks))
        if need > cache.num_free_blocks:
            raise CacheFullError(f"{KV_CACHE_FULL}: the draft's chain needs {need} more blocks of {bs} "
                                 f"tokens, {cache.num_free_blocks} of {cache.num_blocks} free")
        ends = [cache.length(r) + k - 1 for r, k in zip(ids, ks)]                 # the last position written, + 1
        if any(-(-e // bs) > self.max_blocks for e in ends):
            return None
        starts = starts or [cache.length(r) for r in ids]
        for r, k in zip(ids, ks):
            cache.extend(r, k - 1)
        key = (bp, k_max, sampled is not None, q_mass if sampled is not None else 1.0)
        stage = early[0] if early and self.graphs else None                    # (without graphs: step 0 apart)
        if stage is not None and key + (stage.b, stage.n) not in self.compiled and \
                sum(len(c) > 4 for c in self.compiled) >= MAX_EARLY_GRAPHS:
            stage = None                        # (rounds of rarer shapes: step 0 apart, as before)
        early = early if stage is not None else None
        key += (stage.b, stage.n) if stage else ()
        if key not in self.compiled:
            self.compiled[key] = self._build(*key[:4], stage=stage)
        self._fill(self.compiled[key][1], ids, ks, starts, bp, sampled, early)
        return key, B, ks, stage

    def go(self, plan: tuple, hidden: torch.Tensor | None, acc: torch.Tensor | None = None, then=None,
           frame: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        """A planned chain run from its hidden rows [B, D] (and accepted counts acc [B]), or for an early plan from
        the acceptance frame [R, 2 + K] and step 0's rows [N, D] -> as run()."""
        key, B, ks, stage = plan
        graph, st, out = self.compiled[key]
        if stage is None:
            self._feed(st, hidden, acc, B, key[0])
        else:                                  # the frame's rows the pass reads (< F's, plan's check), its columns
            c = min(frame.shape[1], self.frame.shape[1])                     # up to 1 + the most rows a request
            self.frame[:frame.shape[0], :c].copy_(frame[:self.frame.shape[0], :c])
            stage.rows[0][:rows.shape[0]].copy_(rows)
            self.early_runs += 1
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            out = self._body(st, key[1], key[2], key[3])
        if then is not None:
            then()
        toks, q = out
        toks = self.model.ps.decide(toks[:B].cpu()).tolist()           # the round's one host sync
        self.runs += 1
        if isinstance(q, torch.Tensor):
            q = q[:B].cpu()
        elif q is not None:                    # (ids, probs, whole) and the whole q only where a row needs it
            ids, probs, whole = (t[:B].cpu() for t in q[:3])
            q = ids, probs, whole, q[3][:B].cpu() if bool(whole.any()) else None
        return [row[:k] for row, k in zip(toks, ks)], q

    def warmup(self, max_batch: int, ks, stage_of=None) -> int:
        """Capture the greedy chains of k_max in ks for every batch bucket <= max_batch now; with stage_of (the
        step's GraphedForward.stage) also the early graphs of rounds where every request verified k_max drafts."""
        keys = [(bp, k, False, 1.0) for bp in BATCH_BUCKETS if bp <= max_batch for k in ks if k <= self.max_k]
        for key in keys:
            stage = stage_of(key[0], key[0] * (key[1] + 1), 1) if stage_of else None
            for early in (None, stage) if stage else (None,):
                full = key + ((early.b, early.n) if early else ())
                if full not in self.compiled:     # (the stages hold padding now: only the scratch slot is written)
                    self.compiled[full] = self._build(*key, stage=early)
        return len(keys)

    # --- buffers -------------------------------------------------------------------------------
    def _static(self, bp: int, k_max: int, sampled: bool, n: int = 0) -> dict:
        dev, S, MB = self.cache.device, max(k_max - 1, 1), self.max_blocks
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        names = ["base", "acc"] + (list(SAMPLING_PARTS) if sampled else []) + (list(EARLY_PARTS) if n else []) + [
            "tables"]
        kinds = [(i64, (S, bp)), (i64, (bp,))]   # step s's position at acc 0 (-1: padding), accepted counts
        if sampled:                            # per row: temperature, top-k, top-p, noise seed, first draw
            kinds += [(f32, (bp,)), (i64, (bp,)), (f32, (bp,)), (i64, (bp,)), (i64, (bp,))]
        if n:                                  # an early graph's: per row (plan's early), per step-0 token
            kinds += [(i64, (bp,))] * 3 + [(i64, (n,))] * 2
        buf = TwinBuffer(kinds + [(i32, (bp, MB))], dev)     # the round's layout (and sampling) in one upload
        buf.writable()[0][:] = -1                   # all padding: the capture's warm-up writes only the scratch slot
        buf.upload()
        st = dict(zip(names, buf.parts))
        st["buf"], st["host"] = buf, dict(zip(names, buf._host))   # device parts by name; their host twins by name
        st["pos"], st["slots"] = (torch.zeros(S, bp, dtype=i64, device=dev) for _ in range(2))   # (_layout's)
        st["ctx"] = torch.zeros(S, bp, dtype=i32, device=dev)
        st["slots"].fill_(self.scratch_slot)
        st["hidden"] = torch.zeros(bp, self.model.cfg.hidden_size, dtype=self.dtype, device=dev)
        req = torch.arange(bp, dtype=torch.int32, device=dev)
        qstart = torch.arange(bp + 1, dtype=torch.int32, device=dev)
        backend = "triton" if self.graphs else None
        st["batches"] = [AttentionBatch(
            positions=st["pos"][s], slot_mapping=st["slots"][s], token_request=req, context_lens=st["ctx"][s],
            query_start=qstart, block_tables=st["tables"], query_lens=[1] * bp,
            request_ids=[f"\0chain{i}" for i in range(bp)], block_size=self.cache.block_size,
            attention_backend=backend) for s in range(S)]
        return st

    def _fill(self, st: dict, ids, ks, starts, bp: int, sampled=None, early=None) -> None:
        # steps 1 .. k_max - 1's positions at acc 0 (and the sampling rows) written on the host into the twin's parts,
        # then one upload; Python lists and numpy views, not ~15 small tensor ops (as models/batch.lay_out). The graph
        # lays out slots and context lengths from them and the accepted counts (_layout).
        B = len(ids)
        tables = [self.cache._tables[r] for r in ids]
        st["buf"].writable()                                                   # (its last upload has run)
        host = st["host"]
        base_h, acc_h, tab_h = host["base"], host["acc"], host["tables"]
        for s in range(1, base_h.shape[0] + 1):                                # step s of request b, if it drafts it
            base_h[s - 1] = [starts[b] + s - 1 if b < B and s < ks[b] else -1 for b in range(bp)]
        acc_h[:] = 0
        w = max(len(t) for t in tables)
        for b, t in enumerate(tables):                                         # each table, zeros past it to w
            tab_h[b, :len(t)], tab_h[b, len(t):w] = t, 0
        if sampled is not None:
            rows = list(sampled) + [(Sampling(), 0, 0)] * (bp - len(sampled))
            for name, col in zip(SAMPLING_PARTS, ([s.temperature for s, _, _ in rows], [s.top_k for s, _, _ in rows],
                                       [s.top_p for s, _, _ in rows], [seed for _, seed, _ in rows],
                                       [d for _, _, d in rows])):
                host[name][:] = col
        if early is not None:                  # padding: frame row 0, step 0's row 0, no rows past it
            for name, col in zip(EARLY_PARTS, early[1:]):
                host[name][:len(col)], host[name][len(col):] = col, 0
        st["buf"].upload(table_rows_end(st["buf"], B, self.max_blocks, w))    # behind step 0, not waiting on it

    def _feed(self, st: dict, hidden, acc, B: int, bp: int) -> None:
        # the round's hidden rows [B, D] and accepted counts (device copies behind the upload)
        if acc is not None:
            st["acc"][:B].copy_(acc)
        st["hidden"][:B].copy_(hidden)
        if B < bp:
            st["hidden"][B:].zero_()
        if not self.graphs:                    # the reference attention plans from host copies
            base_h, tab_h = st["host"]["base"], st["host"]["tables"]
            host_tables = torch.from_numpy(tab_h.copy())                     # (rows past B, columns past w: unread)
            a = acc.tolist() + [0] * (bp - B) if acc is not None else [0] * bp
            for s, batch in enumerate(st["batches"]):
                batch.host_block_tables = host_tables
                batch.host_starts = [p + a[b] if p >= 0 else 0 for b, p in enumerate(base_h[s].tolist())]
                batch.plans = {}

    def _layout(self, st: dict) -> None:
        # on the device (inside the graph): each step's positions (base + acc), slots from the block tables, context
        # lengths; padding (base -1): position 0, the scratch slot, context 0
        base, bs = st["base"], self.cache.block_size
        live = base >= 0
        pos = torch.where(live, base + st["acc"][None, :], 0)                                  # [S, bp]
        blocks = st["tables"].long().gather(1, (pos // bs).t()).t()                            # [S, bp]
        st["pos"].copy_(pos)
        st["slots"].copy_(torch.where(live, blocks * bs + pos % bs, self.scratch_slot))
        st["ctx"].copy_(torch.where(live, pos + 1, 0))

    # --- the chain -----------------------------------------------------------------------------
    def _body(self, st: dict, k_max: int, sampled: bool, q_mass: float = 1.0, stage=None):
        # -> (drafts [bp, k_max] int64, q: None, [bp, k_max, V] fp32, or top_mass's ids, probs [bp, k_max, w],
        #    whole [bp, k_max] and q' [bp, k_max, V]) on the device
        if stage is not None:                  # an early graph's step 0 over the stage (its batch as a capture's)
            F, batch = self.frame, st["step0"]
            batch.input_ids.copy_(F[st["tok_r"], st["tok_c"]].clamp(0, self.model.cfg.vocab_size - 1))
            h = expect_rows(self.model(batch.input_ids, stage.rows[0], batch, self.cache, step=0), stage.n,
                            "the MTP block")                                                   # [n, D]
            acc = torch.minimum(F[st["frame_rows"], 0].clamp(min=0), st["most"])                  # [bp]
            st["acc"].copy_(acc)
            st["hidden"].copy_(h[st["off"] + acc])
        self._layout(st)
        h, out, qs = st["hidden"], [], []
        layers = self.model.num_cache_layers
        for s in range(k_max):
            logits = self.model.compute_logits(h)                             # [bp, V]
            if sampled:                        # greedy rows: q one-hot, so the draw is their argmax
                q = sampling_probs(logits, st["temp"], st["top_k"], st["top_p"])
                if q_mass < 1:
                    q, ids, probs, whole = top_mass(q, q_mass, DRAFT_Q_WIDTH)
                tok = choose(q, draw_keys(st["seeds"], st["draws"] + s))
                qs.append(q if q_mass >= 1 else (ids, probs, whole, q))
            else:
                tok = argmax_rows(logits)                                      # [bp]
            out.append(tok)
            if s < k_max - 1:
                h = self.model(tok, h, st["batches"][s], self.cache, step=(s + 1) % layers)
        if not sampled:
            return torch.stack(out, 1), None
        if q_mass >= 1:
            return torch.stack(out, 1), torch.stack(qs, 1)
        return torch.stack(out, 1), tuple(torch.stack(t, 1) for t in zip(*qs))

    def _build(self, bp: int, k_max: int, sampled: bool, q_mass: float, stage=None):
        st = self._static(bp, k_max, sampled, stage.n if stage else 0)
        if not self.graphs:
            return None, st, None
        dev = self.cache.device
        if stage is not None:                  # step 0 over the stage's buffers, laid out as a capture's
            st["step0"] = dataclasses.replace(stage.batch(), query_lens=[stage.n // stage.b] * stage.b,
                                              attention_backend="triton", block_size=self.cache.block_size,
                                              request_ids=[f"\0pad{i}" for i in range(stage.b)])
            if self.frame is None:
                self.frame = torch.zeros(BATCH_BUCKETS[-1], 2 + self.max_k, dtype=torch.int64, device=dev)
        stream = capture_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():    # warm-up on scratch rows (step 0: the stage's)
            self._body(st, k_max, sampled, q_mass, stage)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                                   capture_error_mode="thread_local"):
            out = self._body(st, k_max, sampled, q_mass, stage)
        self.pool = graph.pool()
        return graph, st, out
