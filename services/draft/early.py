"""The draft's first step over every row a Verify checked, queued before anyone has read its acceptance (issue 14).

A Verify of k drafts computes k + 1 rows a request (positions p .. p + k). The MTP layer at position p + i takes
(embed(token[p + i + 1]), h[p + i]), and token[p + i + 1] is what the Verify emitted at row i: an accepted draft,
or at the first rejection the target's own token. So the draft's step 0 can run on all k + 1 rows with the emitted
tokens as they sit on the device, before either host knows how many were accepted; the rows past the accepted
count a are computed for nothing and rolled back (causal attention: row i reads rows <= i only).

The target pushes the rows into the bridge ring as soon as its forward is queued, with them the next round's
Propose, which names the transfer its acceptance [B, 2 + K] (accepted | emitted, -1 past a + 1) will come in
(ProposeRequest.acceptance_transfer_id), then queues its logits and acceptance and pushes that (the draft's take
waits for it). The draft lays its pass out first (lay_out: the step over every verified row, the chain's steps at 0
accepted, the device indices; none of it needs the rows' or the frame's values), then takes rows and frame and
queues the step (propose_early) while the target's forward still runs: the GPU runs it right behind the Verify.
The draft reads the acceptance to its host on a side stream (waiting for the target's acceptance, not for its own
step), checks it, commits a + 1 positions a request and chains the rest of the round from row a (engine._chain).

    rows:  [N, D]        N = sum(k_b + 1), request-major
    frame: [R, 2 + K]    int64, row r: request r of the rows set; item b's row is frame_rows[b]
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infra.errors import ServiceError
from models.kv_cache import CacheFullError
from models.cuda_graphs import BATCH_BUCKETS
from services.bridge.rows import expect_rows


def check_items(engine, items, verified: list[int], max_k: int) -> None:
    """An early push's items before anything moves: running requests at the position the draft holds, k + 1 rows
    each (1 <= k + 1 <= max_k + 1), room in max_model_len for the rows and the next round's drafts."""
    if len({it.request_id for it in items}) != len(items):
        raise ServiceError("INVALID_ARGUMENT", "request ids in one Propose must be unique")
    for it, n in zip(items, verified):
        rid = it.request_id
        if rid not in engine.committed:
            raise ServiceError("FAILED_PRECONDITION", f"request {rid!r}: an early Propose names a request the "
                               "draft does not hold (unknown or released)")
        if it.position != engine.committed[rid] + 1 or it.new_token_ids:
            raise ServiceError("FAILED_PRECONDITION" if not it.new_token_ids else "INVALID_ARGUMENT",
                               f"request {rid!r}: position is {it.position} with {len(it.new_token_ids)} "
                               f"new_token_ids; an early Propose names position {engine.committed[rid] + 1} "
                               "and no tokens (they are in the acceptance frame)")
        if not 1 <= n <= max_k + 1:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: its rows set has {n} rows, expected 1 to "
                               f"{max_k + 1} (one a verified position)")
        end = engine.committed[rid] + n + max(it.num_draft_tokens - 1, 0)
        if end > engine.max_model_len:
            raise ServiceError("OUT_OF_RANGE", f"request {rid!r}: {n} verified rows and {it.num_draft_tokens} "
                               f"drafts need {end} cache positions, more than max_model_len {engine.max_model_len}")


@dataclass
class Layout:
    """What lay_out did for an early pass, kept (engine.early) for propose_early of the same items."""
    key: tuple                 # (request ids, verified, frame rows): the pass it was laid out for
    starts: list[int]          # each request's committed positions
    batch: object              # step 0 over every verified row, laid out (into its graph's buffers)
    aux: torch.Tensor | None   # device: frame rows [B], row offsets [B], rows - 1 [B], live [L], tokens' row, col [N]
    chain: tuple | None        # DraftChain.plan of the live requests' steps (None: no chain, or it does not fit)
    hidden: torch.Tensor | None = None     # step 0's rows [N, D], where it ran apart (_steps)

    @property
    def graphed(self) -> bool:
        """Step 0 in the chain's graph (an early plan: it names the stage it took); aux is then in its buffers."""
        return self.chain is not None and self.chain[3] is not None


@torch.inference_mode()
def lay_out(engine, items, verified: list[int], frame_rows: list[int]) -> Layout:
    """The part of an early pass that needs neither the rows' values nor the acceptance, done before the frame
    reaches this host (the target queues its logits and acceptance after the rows): last round's speculative
    positions dropped, step 0 laid out over every verified row, the chain's steps planned (positions at 0 accepted),
    the device indices uploaded. Kept as engine.early for propose_early; a pass whose frame never comes leaves it
    unused (the next Propose drops the positions it extended, as any round's speculative ones)."""
    cache, dev = engine.cache, engine.cache.device
    ids, B = [it.request_id for it in items], len(items)
    engine.early = None
    starts = [engine.committed[r] for r in ids]
    for rid, s in zip(ids, starts):                                     # drop last round's speculative positions
        cache.rollback(rid, cache.length(rid) - s)
    engine.not_held, engine.unsealed = set(), []
    k = [it.num_draft_tokens for it in items]
    live = [b for b in range(B) if k[b] > 0]
    offs = [sum(verified[:b]) for b in range(B)]
    tok_at = [(r, 1 + i) for r, n in zip(frame_rows, verified) for i in range(n)]   # row i's token: emitted i
    idx = [frame_rows, offs, [n - 1 for n in verified], [r for r, _ in tok_at], [c for _, c in tok_at]]
    try:
        batch = cache.prepare(ids, verified)
        stage = _stage(engine, batch) if len(live) == B and max(frame_rows) < BATCH_BUCKETS[-1] else None
        chain = engine.chain_plan(live, ids, k, [starts[b] + 1 for b in live], (stage, *idx) if stage else None) \
            if live else None
    except CacheFullError as e:
        raise ServiceError("RESOURCE_EXHAUSTED", str(e)) from None
    layout = Layout((ids, list(verified), list(frame_rows)), starts, batch, None, chain)
    if not layout.graphed:                                              # (graphed: the indices are in its buffers)
        layout.aux = torch.tensor(idx[0] + idx[1] + idx[2] + live + idx[3] + idx[4]).to(dev, non_blocking=True)
    engine.early = layout
    return layout


def _stage(engine, batch):
    """The CUDA graph bucket step 0 was laid out into (models/cuda_graphs.py), where the chain runs graphs too."""
    chain, stage_of = engine.chain, getattr(engine.forward, "stage", None)
    if chain is None or not chain.graphs or stage_of is None:
        return None
    stage = stage_of(len(batch.query_lens), batch.num_tokens, batch.block_tables.shape[1])
    return stage if stage is not None and stage.holds(batch) else None


@torch.inference_mode()
def propose_early(engine, items, rows: torch.Tensor, verified: list[int], frame: torch.Tensor,
                  frame_rows: list[int], seal: bool = True):
    """items (checked: check_items), rows [sum(verified), D] in items' order, frame [R, 2 + K] -> (drafts, q rows)
    a request, as DraftEngine.propose before its stacking; each item's new_token_ids filled in from the frame.
    Laid out by lay_out first if engine.early is not these items' layout."""
    cache, dev, V = engine.cache, engine.cache.device, engine.vocab_size
    ids, B, W = [it.request_id for it in items], len(items), frame.shape[-1]
    if frame.dim() != 2 or frame.shape[0] <= max(frame_rows) or W < 1 + max(verified):
        for rid in ids:                                                 # a layout made for it: dropped
            cache.rollback(rid, cache.length(rid) - engine.committed[rid])
        engine.early = None
        raise ServiceError("INTERNAL", f"the acceptance frame is {tuple(frame.shape)}, expected rows for "
                           f"{max(frame_rows) + 1} requests of {1 + max(verified)} or more columns")
    key = (ids, list(verified), list(frame_rows))
    plan = engine.early if engine.early is not None and engine.early.key == key else lay_out(engine, items, verified,
                                                                                               frame_rows)
    engine.early = None
    k = [it.num_draft_tokens for it in items]
    live = [b for b in range(B) if k[b] > 0]
    frame = frame.to(dev)
    host = _to_host(frame, engine)                                      # read beside the step, not behind it
    drafts, probs, landed = [[] for _ in items], [[] for _ in items], {}

    def commit(extra: list[int]) -> None:
        # the acceptance on the host, checked, committed: rows past it rolled back (the chain's positions past the
        # accepted ones go with them, extra[b] of them: put back too where the frame is not an acceptance)
        table = (host() if callable(host) else host).tolist()           # [R][2 + K] on the host, as lists
        engine.landed_at = time.perf_counter()          # the pass's part on the round's critical path starts here
        try:
            accepted = _accepted(table, frame_rows, verified, ids, V)
        except ServiceError:
            for rid, n, x in zip(ids, verified, extra):                 # back to where the round found it
                cache.rollback(rid, n + x)
            raise
        for it, rid, r, n, a, s in zip(items, ids, frame_rows, verified, accepted, plan.starts):
            it.new_token_ids = table[r][1:a + 2]
            cache.rollback(rid, n - 1 - a)                               # rows past the accepted: computed for nothing
            engine.committed[rid] = s + a + 1
            engine.tokens.setdefault(rid, []).extend(it.new_token_ids)
        engine.unsealed = list(ids)
        landed["a"] = accepted

    def then() -> None:                                                  # once the chain is queued
        commit([max(x - 1, 0) for x in k])

    try:
        if plan.graphed:                                                 # step 0 and the chain: one replay
            engine._chain(live, None, ids, k, drafts, probs, plan=plan.chain, then=then, frame=frame, rows=rows)
        else:
            _steps(engine, plan, items, rows, verified, frame, live, drafts, probs, then)
        if "a" not in landed:                                            # (no chain, or the round did not fit it)
            commit([0] * B)
            if live:
                ends = [sum(verified[:b]) + landed["a"][b] for b in live]
                engine._rest(live, plan.hidden[torch.tensor(ends).to(dev, non_blocking=True)], ids, k, drafts, probs)
    except CacheFullError as e:
        raise ServiceError("RESOURCE_EXHAUSTED", str(e)) from None
    finally:
        if seal:
            engine.seal()
    return drafts, probs


def _steps(engine, plan: Layout, items, rows, verified: list[int], frame, live: list[int], drafts, probs, then):
    """Step 0 as its own replay (or eagerly), then the chain from the accepted rows where it was planned; step 0's
    rows are kept (plan.hidden) for a round the chain did not take."""
    cache, dev, B = engine.cache, engine.cache.device, len(items)
    rows_at, off, most, at, tok_r, tok_c = plan.aux.split([B, B, B, len(live), sum(verified), sum(verified)])
    toks = frame[tok_r, tok_c].clamp(0, engine.vocab_size - 1)          # [N]: -1 past a
    dtype = next(engine.model.parameters()).dtype
    out = engine.forward(toks, rows.to(dev, dtype), plan.batch, cache, step=0)   # [N, D]
    plan.hidden = hidden = expect_rows(out, plan.batch.num_tokens, "the MTP block")
    if plan.chain is not None:                                           # the chain queued before the acceptance lands
        acc = torch.minimum(frame[rows_at, 0].clamp(min=0), most)                   # [B]: a, kept inside its rows
        engine._chain(live, hidden[(off + acc)[at]], [it.request_id for it in items], [it.num_draft_tokens for it in
                      items], drafts, probs, plan=plan.chain, acc=acc[at], then=then)


def _to_host(frame: torch.Tensor, engine):
    """frame on the host: itself off CUDA, else a callable that waits for a copy made on a side stream (the
    engine's), which waits for what the current stream waited for so far (the frame's arrival), not for the work
    queued after it."""
    if not frame.is_cuda:
        return frame
    now = torch.cuda.current_stream(frame.device)
    side = getattr(engine, "side_stream", None)
    if side is None:
        side = engine.side_stream = torch.cuda.Stream(frame.device)
    out = torch.empty(frame.shape, dtype=frame.dtype, pin_memory=True)
    side.wait_stream(now)
    with torch.cuda.stream(side):
        out.copy_(frame, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    frame.record_stream(side)

    def wait() -> torch.Tensor:
        done.synchronize()
        return out
    return wait


def _accepted(table: list[list[int]], frame_rows: list[int], verified: list[int], ids: list[str], V: int) -> list[int]:
    """Each item's accepted count from the frame, checked: 0 <= a < k + 1 rows, tokens in the vocabulary."""
    out = []
    for rid, r, n in zip(ids, frame_rows, verified):
        a = table[r][0]
        toks = table[r][1:a + 2] if 0 <= a < n else []
        if not 0 <= a < n or not all(0 <= t < V for t in toks):
            raise ServiceError("INTERNAL", f"request {rid!r}: the target's acceptance frame says {a} accepted of "
                               f"{n - 1} drafts with tokens {toks[:8]} (vocab_size {V}): not a Verify's acceptance")
        out.append(a)
    return out
