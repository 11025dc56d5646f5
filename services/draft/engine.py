"""DraftEngine: the MTP proposer with its own paged KV cache.

Alignment: the MTP layer at position i takes (embed(token[i+1]), target hidden h[i]) and predicts
token[i+2]. Per request the cache holds `committed` positions built from target rows; positions
beyond are this round's speculative steps (fed the MTP's own normed hidden) and are rolled back
at the next Propose before the new committed rows are appended.

Prefix caching (models/prefix_cache.py, shift 1: block j is decided by tokens[0 : (j+1)*bs + 1]): a new
request starts on the cached blocks of its tokens. The target sends no rows for the first
`cached_tokens` positions (its own prefix cache held them), so the draft must hold at least those;
when it does not (its cache evicted them), it does not take the request (`not_held`), and the
gateway re-syncs it with rows of every position (gateway/resync.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels.dispatch import argmax_rows, sampling_probs
from models.kv_cache import CacheFullError, PagedKVCache
from infra.defaults import DRAFT_Q_MASS, DRAFT_Q_WIDTH, MAX_DRAFT_TOKENS
from infra.errors import ServiceError
from services.bridge.rows import expect_rows
from services.draft import early
from kernels.noise import choose, draw_keys, top_mass
from services.sampling import Sampling, TopQ, noise_seed


@dataclass
class ProposeItem:
    request_id: str
    new_token_ids: list[int]
    num_draft_tokens: int
    sampling: Sampling
    position: int = 0       # index of new_token_ids[0] in the request's sequence (0: new request)
    cached_tokens: int = 0  # new request: its first positions come without rows (the target had them cached)


class DraftEngine:
    graph_row_inputs = 1                     # CUDA graphs: the target hidden rows after the tokens
    prefix_shift = 1                         # prefix caching: block j is decided by tokens[0 : (j+1)*bs + 1]
    def __init__(self, model, cache: PagedKVCache, max_model_len: int):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.forward = model                 # or a models.cuda_graphs.GraphedForward of it
        self.chain = None                    # services/draft/chain.py: greedy steps 2..k in one replay
        self.vocab_size = model.cfg.vocab_size
        self.committed: dict[str, int] = {}      # request id -> committed cache positions
        self.sampling: dict[str, Sampling] = {}
        self.noise: dict[str, list[int]] = {}     # sampled requests: [seed, draws so far] (kernels/noise.py)
        self.tokens: dict[str, list[int]] = {}   # prefix caching: every token given (names full blocks)
        self.not_held: set[str] = set()          # new requests of the last Propose it could not take
        self.unsealed: list[str] = []            # requests of the last Propose whose blocks seal() has not sealed
        self.q_mass = DRAFT_Q_MASS               # sampled drafts: from q's top tokens of this mass (1: all of q)
        self.landed_at = 0.0                     # an early pass (early.py): when its acceptance reached the host
        self.early = None                        # an early pass's layout (early.Layout), made before its frame came

    def graphs_enabled(self, warmup_batch: int = 0) -> None:
        """CUDA graphs are on (services/launch.py): a round's steps 2..k run as one replay too (chain.py),
        captured now for greedy rounds of up to 4 drafts and batches up to warmup_batch (others on first use)."""
        from services.draft.chain import DraftChain
        self.chain = DraftChain(self.model, self.cache, self.max_model_len, MAX_DRAFT_TOKENS, graphs=True)
        self.chain.warmup(warmup_batch, ks=(1, 2, 3, 4), stage_of=getattr(self.forward, "stage", None))

    def expected_rows(self, items: list[ProposeItem]) -> dict[str, int]:
        """Rows each item must bring: one per new token; a new request's first token has none.
        Checks each item's position against this side's bookkeeping first."""
        if len({it.request_id for it in items}) != len(items):
            raise ServiceError("INVALID_ARGUMENT", "request ids in one Propose must be unique")
        out = {}
        for it in items:
            rid, known = it.request_id, it.request_id in self.committed
            seen = self.committed[rid] + 1 if known else 0           # tokens given so far
            if it.position != seen:
                raise ServiceError("FAILED_PRECONDITION", f"request {rid!r}: position is {it.position}, the draft "
                                   f"holds {seen} tokens of it" + ("" if known else " (unknown or released request)"))
            if not it.new_token_ids or (not known and len(it.new_token_ids) < 2):
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: new_token_ids has "
                                   f"{len(it.new_token_ids)} tokens, a new request needs its prompt and first token")
            # cache positions after this round: one a token given but the last (token i + 1 pairs with row i),
            # then one a draft but the last (draft j + 1 is drafted from draft j's position)
            end = it.position + len(it.new_token_ids) - 1 + max(it.num_draft_tokens - 1, 0)
            if end > self.max_model_len:
                raise ServiceError("OUT_OF_RANGE", f"request {rid!r}: position {it.position} + "
                                   f"{len(it.new_token_ids)} new tokens + {it.num_draft_tokens} drafts need {end} "
                                   f"cache positions, more than max_model_len {self.max_model_len}")
            if it.cached_tokens and (known or it.cached_tokens > len(it.new_token_ids) - 2):
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: cached_tokens is {it.cached_tokens}; "
                                   f"it must be 0 for a running request and below the prompt's length")
            out[rid] = len(it.new_token_ids) - (not known) - it.cached_tokens
        return out

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem], rows: dict[str, torch.Tensor], seal: bool = True):
        """rows: request id -> target hidden rows [n_r, D] (already contract-checked)
        -> per item (draft ids [k], draft probs: None (greedy), TopQ (q_mass < 1) or [k, V]).
        seal False: the committed blocks go to the prefix cache only when seal() is called (rows whose bridge
        checks run after the compute: services/draft/server.py)."""
        for it in items:
            bad = [t for t in it.new_token_ids if t >= self.vocab_size]
            if bad:
                raise ServiceError("INVALID_ARGUMENT", f"request {it.request_id!r}: new_token_ids holds "
                                   f"token id {bad[0]}, vocab_size is {self.vocab_size}")
        fresh = [it.request_id for it in items if it.request_id not in self.committed]
        self.not_held, self.unsealed, start, self.early = set(), [], {}, None
        for it in items:
            if it.request_id in fresh:
                start[it.request_id] = self._start(it)
            else:                              # drop last round's speculative positions
                self.cache.rollback(it.request_id, self.cache.length(it.request_id) - self.committed[it.request_id])
            if it.request_id not in self.not_held:
                self.tokens.setdefault(it.request_id, []).extend(it.new_token_ids)
        ids = [it.request_id for it in items]
        k = [it.num_draft_tokens for it in items]
        # step 1 appends the committed rows; each row is paired with the token after its position
        toks = [it.new_token_ids[start[it.request_id] + 1:] if it.request_id in fresh else it.new_token_ids
                for it in items]
        skip = {it.request_id: start[it.request_id] - it.cached_tokens for it in items if it.request_id in start}
        rows = {rid: r[skip.get(rid, 0):] for rid, r in rows.items()}       # rows of positions found cached: unused
        active = [b for b, t in enumerate(toks) if t and ids[b] not in self.not_held]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        try:
            if active:
                parts = [rows[ids[b]] for b in active]                  # one request: its rows as they came
                hidden = self._step([ids[b] for b in active], [toks[b] for b in active],
                                    torch.cat(parts) if len(parts) > 1 else parts[0], step=0)
                for b in active:
                    self.committed[ids[b]] = self.cache.length(ids[b])
                self.unsealed = [ids[b] for b in active]
                if len(active) == 1:                                        # [1, D] its MTP hidden: a view
                    last = hidden[-1:]
                else:                                                       # not waiting on step 0:
                    ends = torch.tensor(list(accumulate(len(toks[b]) for b in active))) - 1
                    last = hidden[ends.to(hidden.device, non_blocking=True)]    # [len(active), D] each one's
                live = [b for b in active if k[b] > 0]
                if live and len(live) < len(active):                         # (rows as they are when all draft)
                    keep = torch.tensor([i for i, b in enumerate(active) if k[b] > 0])
                    last = last[keep.to(last.device, non_blocking=True)]
                self._rest(live, last, ids, k, drafts, probs)
        except CacheFullError as e:
            raise ServiceError("RESOURCE_EXHAUSTED", str(e)) from None
        finally:
            if seal:
                self.seal()
        return [(d, _stacked(p)) for d, p in zip(drafts, probs)]

    def lay_out_early(self, items: list[ProposeItem], verified: list[int], frame_rows: list[int]) -> None:
        """An early Propose's layout, before its acceptance frame reaches this host (services/draft/early.py)."""
        early.lay_out(self, items, verified, frame_rows)

    def propose_early(self, items: list[ProposeItem], rows: torch.Tensor, verified: list[int], frame: torch.Tensor,
                      frame_rows: list[int], seal: bool = True):
        """A Propose pushed before the target read its acceptance (services/draft/early.py) -> as propose."""
        drafts, probs = early.propose_early(self, items, rows, verified, frame, frame_rows, seal)
        return [(d, _stacked(p)) for d, p in zip(drafts, probs)]

    def seal(self) -> None:
        """The last Propose's committed blocks into the prefix cache (models/prefix_cache.py)."""
        for rid in self.unsealed:
            if rid in self.committed:
                self.cache.seal(rid, self.tokens[rid], self.committed[rid])
        self.unsealed = []

    def _rest(self, live: list[int], last: torch.Tensor, ids: list[str], k: list[int], drafts: list,
              probs: list) -> None:
        """Steps 2..k of live's requests from their MTP hidden rows last: the chain's one replay, else the loop."""
        if not (live and self._chain(live, last, ids, k, drafts, probs)):
            self._loop(live, dict(zip(live, last)), ids, k, drafts, probs)

    def chain_plan(self, live: list[int], ids: list[str], k: list[int], starts: list[int] | None = None,
                   early: tuple | None = None):
        """DraftChain.plan of live's requests' steps 2..k (early.py: starts, step 1's positions at 0 accepted; early,
        step 0 in the graph too) -> the plan, or None when there is no chain or the round does not fit it."""
        if self.chain is None:
            return None
        rids = [ids[b] for b in live]
        samplings = [self.sampling[r] for r in rids]
        sampled = None if all(s.greedy for s in samplings) else [
            (s, *(tuple(self.noise[r]) if not s.greedy else (0, 0))) for r, s in zip(rids, samplings)]
        return self.chain.plan(rids, [k[b] for b in live], sampled, self.q_mass, starts, early)

    def _chain(self, live: list[int], last: torch.Tensor | None, ids: list[str], k: list[int], drafts: list,
               probs: list, plan=None, **go) -> bool:
        """Steps 2..k in one replay (chain.py) from live's MTP hidden rows last [len(live), D]; False when there
        is no chain or the round does not fit it. plan: chain_plan's, made earlier; go: DraftChain.go's acc, then,
        frame and rows (early.py)."""
        plan = plan or self.chain_plan(live, ids, k)
        if plan is None:
            return False
        toks, q = self.chain.go(plan, last, **go)
        for i, b in enumerate(live):
            r, s = ids[b], self.sampling[ids[b]]
            drafts[b] = toks[i]
            if not s.greedy:
                self._draw(r, k[b])                                          # the draws the chain took
                probs[b] = list(q[i, : k[b]]) if isinstance(q, torch.Tensor) else [
                    q[3][i, j] if q[2][i, j] else (q[0][i, j], q[1][i, j]) for j in range(k[b])]
        return True

    def _loop(self, live: list[int], last: dict, ids: list[str], k: list[int], drafts: list, probs: list) -> None:
        """Steps 2..k, one at a time: each chooses its tokens on the host before the next step runs."""
        s = 0
        while live:                            # steps 2..k reuse the layer on its own normed hidden
            for b, (tok, q) in zip(live, self._pick(torch.stack([last[b] for b in live]), [ids[b] for b in live])):
                drafts[b].append(tok)
                if q is not None:
                    probs[b].append(q)
            s += 1
            live = [b for b in live if k[b] > s]
            if live:
                h = self._step([ids[b] for b in live], [[drafts[b][-1]] for b in live],
                               torch.stack([last[b] for b in live]), step=s)
                last.update(zip(live, h))

    def _start(self, it: ProposeItem) -> int:
        """A new request: its cache, on the prefix cache's blocks where it has them (never its last
        position, whose MTP hidden drafts) -> positions found. Fewer than it.cached_tokens: not taken."""
        rid, T = it.request_id, len(it.new_token_ids) - 1                 # T positions: tokens 1..T with rows 0..T-1
        hit = self.cache.lookup(it.new_token_ids, T - 1) if self.cache.pool.enabled else None
        found = hit.positions if hit else 0
        if found < it.cached_tokens:
            self.cache.drop(hit)
            self.not_held.add(rid)
            return found
        self.cache.allocate(rid, hit)
        self.committed[rid], self.sampling[rid] = found, it.sampling
        if not it.sampling.greedy:
            self.noise[rid] = [noise_seed(it.sampling), 0]
        return found

    def _step(self, ids: list[str], toks: list[list[int]], hidden: torch.Tensor, step: int) -> torch.Tensor:
        batch = self.cache.prepare(ids, [len(t) for t in toks], [t for ts in toks for t in ts])
        out = self.forward(batch.input_ids, hidden.to(self.cache.device, next(self.model.parameters()).dtype),
                           batch, self.cache, step=step % self.model.num_cache_layers)
        return expect_rows(out, batch.num_tokens, "the MTP block")

    def _pick(self, hidden: torch.Tensor, ids: list[str]):
        """hidden [M, D] of requests `ids` -> (token, q) per row: argmax when greedy (q None), else a draw from q
        (cut to its top tokens of mass q_mass: q then (ids, probs) [w]; a row too flat to cut: q [V]) with the
        request's next keyed noise."""
        samplings = [self.sampling[r] for r in ids]
        logits = self.model.compute_logits(hidden)
        if all(s.greedy for s in samplings):
            return [(int(t), None) for t in self.model.ps.decide(argmax_rows(logits).cpu()).tolist()]
        dev = logits.device
        q = sampling_probs(logits, torch.tensor([s.temperature for s in samplings], device=dev),
                           torch.tensor([s.top_k for s in samplings], device=dev),
                           torch.tensor([s.top_p for s in samplings], device=dev))
        if self.q_mass < 1:
            q, top_ids, top_probs, whole = top_mass(q, self.q_mass, DRAFT_Q_WIDTH)
        seeds, draws = zip(*[self._draw(r, 1) if not s.greedy else (0, 0) for r, s in zip(ids, samplings)])
        toks = choose(q, draw_keys(torch.tensor(seeds, device=dev), torch.tensor(draws, device=dev)))
        toks = self.model.ps.decide(toks.cpu()).tolist()                         # rank 0 decides
        if self.q_mass >= 1:
            q = q.cpu()
        else:                                  # whole rows (too flat to cut) go as q itself
            whole = whole.cpu()
            dense = dict(zip(whole.nonzero().flatten().tolist(), q[whole.to(dev)].cpu())) if bool(whole.any()) else {}
            q = [dense.get(i) if whole[i] else row for i, row in enumerate(zip(top_ids.cpu(), top_probs.cpu()))]
        return [(t, None if s.greedy else qi) for t, qi, s in zip(toks, q, samplings)]

    def _draw(self, rid: str, n: int) -> tuple[int, int]:
        """A sampled request's seed and its next draw index; takes n draws."""
        entry = self.noise[rid]
        draw, entry[1] = entry[1], entry[1] + n
        return entry[0], draw

    def release(self, ids: list[str]) -> int:
        n, self.early = 0, None
        for rid in ids:
            n += self.committed.pop(rid, None) is not None
            self.sampling.pop(rid, None)
            self.noise.pop(rid, None)
            self.tokens.pop(rid, None)
            self.cache.release(rid)
        return n


def _stacked(rows: list):
    """One request's per-position q rows -> None, TopQ (every row (ids, probs)) or q [k, V] (some row whole)."""
    if not rows:
        return None
    if all(isinstance(r, tuple) for r in rows):
        return TopQ.kept(torch.stack([i for i, _ in rows]), torch.stack([p for _, p in rows]))
    V = next(r for r in rows if not isinstance(r, tuple)).shape[-1]
    return torch.stack([TopQ(r[0][None], r[1][None]).dense(V, "cpu")[0] if isinstance(r, tuple) else r
                        for r in rows])
