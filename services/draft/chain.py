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
"""
from __future__ import annotations

import torch

from models.cuda_graphs import BATCH_BUCKETS, PAD_REQUEST, _bucket, gc_paused
from kernels.dispatch import argmax_rows, sampling_probs
from infra.errors import KV_CACHE_FULL
from models.batch import TwinBuffer, table_rows_end
from models.kv_cache import AttentionBatch, CacheFullError, PagedKVCache
from infra.defaults import DRAFT_Q_WIDTH
from kernels.noise import choose, draw_keys, top_mass
from services.sampling import Sampling


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
        self.compiled: dict[tuple[int, int], tuple] = {}
        self.pool = None
        self.runs = self.replays = 0       # rounds drafted here; of those, replayed graphs

    def run(self, ids: list[str], hidden: torch.Tensor, ks: list[int],
            sampled: list[tuple[Sampling, int, int]] | None = None, q_mass: float = 1.0,
            acc: torch.Tensor | None = None, starts: list[int] | None = None, then=None):
        """acc, starts (an early pass, services/draft/early.py): step 1 of request b writes position starts[b] +
        acc[b], acc [B] on the device (the accepted counts, not yet known on the host; the cache holds the most
        positions they could need); then(): host work to run once the replay is queued, before its one sync."""
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
        if key not in self.compiled:
            self.compiled[key] = self._build(*key)
        graph, st, out = self.compiled[key]
        self._fill(st, ids, hidden, ks, starts, bp, sampled, acc)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            out = self._body(st, k_max, sampled is not None, key[3])
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

    def warmup(self, max_batch: int, ks) -> int:
        """Capture the greedy chains of k_max in ks for every batch bucket <= max_batch now."""
        keys = [(bp, k, False, 1.0) for bp in BATCH_BUCKETS if bp <= max_batch for k in ks if k <= self.max_k]
        for key in keys:
            if key not in self.compiled:
                self.compiled[key] = self._build(*key)
        return len(keys)

    # --- buffers -------------------------------------------------------------------------------
    def _static(self, bp: int, k_max: int, sampled: bool) -> dict:
        dev, S, MB = self.cache.device, max(k_max - 1, 1), self.max_blocks
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        names = ["base", "acc"] + (["temp", "top_k", "top_p", "seeds", "draws"] if sampled else []) + ["tables"]
        kinds = [(i64, (S, bp)), (i64, (bp,))]   # step s's position at acc 0 (-1: padding), accepted counts
        if sampled:                            # per row: temperature, top-k, top-p, noise seed, first draw
            kinds += [(f32, (bp,)), (i64, (bp,)), (f32, (bp,)), (i64, (bp,)), (i64, (bp,))]
        buf = TwinBuffer(kinds + [(i32, (bp, MB))], dev)     # the round's layout (and sampling) in one upload
        buf.writable()[0][:] = -1                   # all padding: the capture's warm-up writes only the scratch slot
        buf.upload()
        st = dict(zip(names, buf.parts))
        st["buf"] = buf
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

    def _fill(self, st: dict, ids, hidden, ks, starts, bp: int, sampled=None, acc=None) -> None:
        # steps 1 .. k_max - 1's positions at acc 0 (and the sampling rows) written on the host into the twin's parts,
        # then one upload (acc on the device copied in behind it); Python lists and numpy views, not ~15 small tensor
        # ops (as models/batch.lay_out). The graph lays out slots and context lengths from them (_layout).
        B = len(ids)
        tables = [self.cache._tables[r] for r in ids]
        base_h, acc_h, *samp_h, tab_h = st["buf"].writable()
        for s in range(1, base_h.shape[0] + 1):                                # step s of request b, if it drafts it
            base_h[s - 1] = [starts[b] + s - 1 if b < B and s < ks[b] else -1 for b in range(bp)]
        acc_h[:] = 0
        w = max(len(t) for t in tables)
        for b, t in enumerate(tables):                                         # each table, zeros past it to w
            tab_h[b, :len(t)], tab_h[b, len(t):w] = t, 0
        if sampled is not None:
            rows = list(sampled) + [(Sampling(), 0, 0)] * (bp - len(sampled))
            for h, col in zip(samp_h, ([s.temperature for s, _, _ in rows], [s.top_k for s, _, _ in rows],
                                       [s.top_p for s, _, _ in rows], [seed for _, seed, _ in rows],
                                       [d for _, _, d in rows])):
                h[:] = col
        st["buf"].upload(table_rows_end(st["buf"], B, self.max_blocks, w))    # behind step 0, not waiting on it
        if acc is not None:
            st["acc"][:B].copy_(acc)
        st["hidden"][:B].copy_(hidden)
        if B < bp:
            st["hidden"][B:].zero_()
        if not self.graphs:                    # the reference attention plans from host copies
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
    def _body(self, st: dict, k_max: int, sampled: bool, q_mass: float = 1.0):
        # -> (drafts [bp, k_max] int64, q: None, [bp, k_max, V] fp32, or top_mass's ids, probs [bp, k_max, w],
        #    whole [bp, k_max] and q' [bp, k_max, V]) on the device
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

    def _build(self, bp: int, k_max: int, sampled: bool, q_mass: float):
        st = self._static(bp, k_max, sampled)
        if not self.graphs:
            return None, st, None
        dev = self.cache.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():                # warm-up on scratch rows only
            self._body(st, k_max, sampled, q_mass)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                                   capture_error_mode="thread_local"):
            out = self._body(st, k_max, sampled, q_mass)
        self.pool = graph.pool()
        return graph, st, out
