"""TargetEngine: the verifier's state machine over the model and its paged KV cache.

Per request it keeps the pending token (the last committed token, whose KV is not in the cache
yet), the sampling parameters and its noise seed and draw count (kernels/noise.py: sampling draws its noise on
the device, keyed, so a seeded request ignores its batch-mates). Tokens are committed here and nowhere else.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import flashinfer_sampling
from kernels.dispatch import chain_verifier, greedy_accept, rejection_sample, take_spans
from kernels.noise import choose, draw_keys
from models.kv_cache import CacheFullError, PagedKVCache
from infra.errors import ServiceError
from services.bridge.rows import expect_rows
from services.sampling import Sampling, TopQ, noise_seed
from services.target import prefill as plan
from services.target.synthetic import STREAM as SYNTHETIC_STREAM, synthetic_counts, synthetic_emitted
from services.target.verify_io import (PrefillStep, Prefilled, Verified, check_q, draws, round_inputs,
                                       target_probs, token_logprobs)


@dataclass
class _Request:
    pending_token: int
    num_tokens: int
    sampling: Sampling
    tokens: list[int]                 # every token so far (the pending one last): names its full blocks
    seed: int = 0                     # noise seed (kernels/noise.py): draw 0 chose the first token,
    draws: int = 1                    # each sampled Verify takes two (its uniforms, then its Exp(1) noise)
    synthetic: list[int] | None = None  # --synthetic-acceptance: [seed, draws taken] (services/target/synthetic.py)


WARM_DRAFTS = 4                              # acceptance kernels compiled at start for 0 .. this many drafts


class TargetEngine:
    graph_row_inputs = 0                     # CUDA graphs: tokens only
    prefix_shift = 0                         # prefix caching: block j is decided by tokens[0 : (j+1)*bs]
    synthetic_acceptance: tuple[float, ...] | None = None   # BENCHMARK ONLY: services/target/synthetic.py
    # rank 0 of a service with a bridge: (transfer id, a Verify's rows [N, D]) -> the rows sent (a copy), or None
    push_rows: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None
    push_acceptance: Callable[[torch.Tensor, torch.Tensor], None] | None = None   # (acceptance [B, K+2], rows pushed)

    def graphs_enabled(self, warmup_batch: int = 0) -> None:
        """CUDA graphs are on (services/launch.py): compile the acceptance kernels now for every draft count a
        round may bring (0 .. WARM_DRAFTS), greedy and sampled. Triton compiles a kernel per draft count on first
        use, so the first round at a new k (an adaptive policy's k = 1 probe) paid it inside a Verify."""
        dev, V = self.cache.device, self.vocab_size
        for k in range(WARM_DRAFTS + 1):         # inputs laid out as verify's (Triton specializes on strides)
            _, _, drafts, n, idx = round_inputs([[0] * k], dev)
            greedy_accept(torch.zeros(k + 1, V, device=dev), idx, drafts, n)
            if k:
                p = torch.full((1, k + 1, V), 1.0 / V, device=dev)
                rejection_sample(p, torch.zeros(1, k, V, device=dev), drafts, n, torch.ones(1, k, device=dev),
                                 torch.ones(1, V, device=dev))

    def __init__(self, model, cache: PagedKVCache, max_model_len: int):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.forward = model                 # or a models.cuda_graphs.GraphedForward of it
        self.vocab_size = model.cfg.vocab_size
        self.requests: dict[str, _Request] = {}
        self.partial: dict[str, tuple[int, int]] = {}    # prefilling in chunks: (positions computed, prompt length)
        self.named: dict[str, float] = {}    # request id -> when a Prefill or Verify last named it (idle())

    def _check_tokens(self, rid: str, field: str, ids: list[int]) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: {field} holds token id {bad[0]}, "
                                                   f"vocab_size is {self.vocab_size}")

    @torch.inference_mode()
    def prefill(self, items: list[tuple[str, list[int], Sampling]], logprobs: list[tuple[int | None, bool]] | None = None,
                budgets: list[int] | None = None):
        """-> Prefilled. logprobs: per item (top-n for the first token or None, whether to score the prompt);
        budgets: per item at most this many positions now (0: all; services/target/prefill.py)."""
        step = self._prefill_begin(items, logprobs, budgets)
        try:
            batch = self._prepare(step.seqs)
        except ServiceError:                     # no room: nothing was extended, prompts begun stay begun
            self._prefill_abort(step.new)
            raise
        hidden = self._run_prefill(batch, items)
        return self._prefill_end(step, hidden)

    def _prefill_begin(self, items, logprobs, budgets) -> PrefillStep:
        """Check the items and start their caches (prefix hits) -> the positions each computes now."""
        scored = [bool(w[1]) for w in logprobs] if logprobs else [False] * len(items)
        plan.check_items(self, items, scored)
        self.named.update(dict.fromkeys([rid for rid, _, _ in items], time.monotonic()))
        new = [rid for rid, _, _ in items if rid not in self.partial]
        try:
            spans = plan.spans(self, items, scored, budgets or [0] * len(items))
        except BaseException:
            self._prefill_abort(new)
            raise
        return PrefillStep(items, logprobs, spans, {rid: p[s:e] for (rid, p, _), (s, e) in zip(items, spans)}, new)

    def _prefill_abort(self, rids: list[str]) -> None:
        """Drop these requests' prefill state and cache (a failed step: the gateway starts them again or ends them)."""
        for rid in rids:
            self.partial.pop(rid, None)
            self.cache.release(rid)

    def _run_prefill(self, batch, items) -> torch.Tensor:
        try:
            return self._run(batch)
        except BaseException:                    # the step's caches were extended: its prompts are not resumable
            self._prefill_abort([rid for rid, _, _ in items])
            raise

    def _prefill_end(self, step: PrefillStep, hidden: torch.Tensor):
        """The computed rows [sum(end - start), D] -> Prefilled: first tokens of the prompts prefilled to the end."""
        items, logprobs, spans = step.items, step.logprobs, step.spans
        done = [b for b, ((_, p, _), (_, e)) in enumerate(zip(items, spans)) if e == len(p)]
        ends = torch.tensor([e - s for s, e in spans]).cumsum(0) - 1
        seeds = [noise_seed(items[b][2], 0) for b in done]
        last_logits, sampled = None, []
        if done:                                                                  # prompts prefilled to the end
            last_logits = self.model.compute_logits(hidden[ends[done].to(hidden.device)])      # [B done, V]
            probs = target_probs(last_logits, [items[b][2] for b in done])
            zero = torch.zeros(len(done), dtype=torch.long, device=probs.device)
            keys = draw_keys(torch.tensor(seeds, device=probs.device), zero)
            sampled = self.model.ps.decide(choose(probs, keys).cpu()).tolist()         # draw 0 of each request
        first = [0] * len(items)
        for (rid, prompt, _), (_, e) in zip(items, spans):
            self.cache.seal(rid, prompt, e)
            self.partial[rid] = (e, len(prompt))
        for b, tok, seed in zip(done, sampled, seeds):
            rid, prompt, s = items[b]
            del self.partial[rid]
            first[b] = tok
            self.requests[rid] = _Request(tok, len(prompt) + 1, s, list(prompt) + [tok], seed, synthetic=(
                None if self.synthetic_acceptance is None else [noise_seed(s, SYNTHETIC_STREAM), 0]))
        out = None if logprobs is None else plan.score(self, items, logprobs, hidden, spans, last_logits, sampled)
        return Prefilled(first, hidden, out, [s for s, _ in spans], [e for _, e in spans])

    @torch.inference_mode()
    def verify(self, items: list[tuple[str, list[int], torch.Tensor | None]], logprobs: list[int | None] | None = None,
               push: int = 0):
        """items: (request id, draft tokens [k], draft probs: [k, V], TopQ [k, w] or None) -> Verified. logprobs:
        per item top-n or None. push: a bridge transfer id for every verified row, sent as soon as the forward is
        queued (push_rows), before the acceptance's sync: the draft finds them when the Propose comes."""
        reqs, seqs = self._verify_begin(items)
        return self._verify_end(items, logprobs, reqs, self._forward(seqs), push)

    @torch.inference_mode()
    def verify_and_prefill(self, items, logprobs, prefill_items, prefill_logprobs=None, budgets=None, push=0):
        """A Verify with a Prefill riding it (VerifyRequest.prefill): both in ONE forward, the Verify's tokens first,
        so new prompts cost the step their compute, not another read of every weight -> (Verified, Prefilled, or
        the ServiceError that refused the Prefill: bad items, or no room in the cache; the Verify then runs alone)."""
        reqs, vseqs = self._verify_begin(items)
        try:
            step = self._prefill_begin(prefill_items, prefill_logprobs, budgets)
        except ServiceError as e:
            return self.verify(items, logprobs, push), e
        try:
            batch = self._prepare({**vseqs, **step.seqs})
        except ServiceError as e:                # no room for both: its new prompts wait, prompts begun stay begun
            self._prefill_abort(step.new)
            return self.verify(items, logprobs, push), e
        hidden = self._run_prefill(batch, prefill_items)
        nv = sum(len(s) for s in vseqs.values())
        return self._verify_end(items, logprobs, reqs, hidden[:nv], push), self._prefill_end(step, hidden[nv:])

    def _verify_begin(self, items):
        """Check a Verify's items -> (their requests, the tokens each computes: the pending one and the drafts)."""
        self.named.update(dict.fromkeys([rid for rid, _, _ in items if rid in self.requests], time.monotonic()))
        for rid, drafts, q in items:
            if rid not in self.requests:
                raise ServiceError("FAILED_PRECONDITION", f"request {rid!r} is not running on the target "
                                                          "(never prefilled, or released)")
            self._check_tokens(rid, "draft_token_ids", drafts)
            r = self.requests[rid]
            if r.num_tokens + len(drafts) > self.max_model_len:
                raise ServiceError("OUT_OF_RANGE", f"request {rid!r}: {r.num_tokens} tokens + {len(drafts)} "
                                                   f"drafts exceed max_model_len {self.max_model_len}")
            if self.synthetic_acceptance is not None and not r.sampling.greedy:
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: temperature {r.sampling.temperature}, but "
                                   "--synthetic-acceptance (a benchmark mode) serves greedy requests only")
            check_q(rid, q, len(drafts), self.vocab_size)
        if len({rid for rid, _, _ in items}) != len(items):
            raise ServiceError("INVALID_ARGUMENT", "request ids in one Verify must be unique")
        reqs = [self.requests[rid] for rid, _, _ in items]
        return reqs, {rid: [r.pending_token] + list(d) for (rid, d, _), r in zip(items, reqs)}

    def _verify_end(self, items, logprobs, reqs, hidden: torch.Tensor, push: int = 0):
        """The Verify's rows [N, D], N = sum(k + 1) -> acceptance, the committed tokens and rows: Verified."""
        pushed = self.push_rows(push, hidden) if push and self.push_rows is not None else None
        B, K = len(items), max(len(d) for _, d, _ in items)
        V, dev = self.vocab_size, self.cache.device        # acceptance runs where the logits are (Triton on CUDA)
        k, starts, drafts, k_dev, idx = round_inputs([d for _, d, _ in items], dev)   # queued behind the step
        logits = self.model.compute_logits(hidden)                               # [N, V]
        if all(r.sampling.greedy for r in reqs):
            both, target = greedy_accept(logits, idx, drafts, k_dev)             # [B, K+2]: accepted | emitted
            if self.synthetic_acceptance is not None and K:     # BENCHMARK ONLY, K = 0: nothing to accept
                a = torch.from_numpy(synthetic_counts(k, K, self.synthetic_acceptance, [r.synthetic for r in reqs]))
                a = a.to(dev, non_blocking=True)                                  # (drawn on the host, as before)
                both = torch.cat([a[:, None], synthetic_emitted(target, drafts, a)], 1)
        else:
            p = target_probs(logits, [r.sampling for (_, d, _), r in zip(items, reqs) for _ in range(len(d) + 1)])
            p = p[idx] * (torch.arange(K + 1)[None, :] <= k[:, None]).to(dev)[..., None]   # [B, K+1, V]: rows <= k
            q = torch.zeros(B, K, V, device=dev)
            for b, (_, d, qb) in enumerate(items):
                if isinstance(qb, TopQ):
                    q[b, : len(d)] = qb.dense(V, dev)
                elif qb is not None:
                    q[b, : len(d)] = qb.to(dev)
                else:                                                               # greedy draft: one-hot
                    q[b, torch.arange(len(d), device=dev), drafts[b, : len(d)]] = 1.0
            if chain_verifier(p, k, seeded=any(r.sampling.seed is not None for r in reqs)) == "flashinfer":
                accepted, emitted = flashinfer_sampling.chain_verify(p, q, drafts)   # TANDEM_VERIFIER=flashinfer
            else:
                accepted, emitted = rejection_sample(p, q, drafts, k_dev, *draws(reqs, K, self.vocab_size, dev))
            both = torch.cat([accepted.view(B, 1).long(), emitted.long()], 1)      # [B, K+2]
        if pushed is not None and self.push_acceptance is not None:   # the next Propose, before the sync
            self.push_acceptance(both, pushed)
        both = both.cpu()                                                         # the one device-to-host copy
        accepted, emitted = both[:, 0], both[:, 1:K + 2]
        accepted, emitted = self.model.ps.decide(accepted), self.model.ps.decide(emitted)   # rank 0 decides
        out_tokens, spans, accepted = [], [], accepted.tolist()                    # host lists: no per-item indexing
        for (rid, d, _), r, a, em, s0 in zip(items, reqs, accepted, emitted.tolist(), starts):
            toks = em[: a + 1]
            self.cache.rollback(rid, len(d) - a)                                 # drop rejected positions
            r.pending_token, r.num_tokens = toks[-1], r.num_tokens + a + 1
            r.tokens += toks
            self.cache.seal(rid, r.tokens, r.num_tokens - 1)                      # name full committed blocks
            out_tokens.append(toks)
            spans.append((s0, s0 + a + 1))
        rows = take_spans(hidden, spans) if pushed is None else pushed    # the committed rows (a copy), or all pushed
        lps = None if logprobs is None else [token_logprobs(logits[s:e], toks, n) if n is not None else []
                                             for (s, e), toks, n in zip(spans, out_tokens, logprobs)]
        return Verified(accepted, out_tokens, rows, lps, pushed is not None)

    @torch.inference_mode()
    def recompute_rows(self, items: list[tuple[str, list[int]]]) -> torch.Tensor:
        """items: (request id, its committed tokens) -> final-norm hidden rows of every position but
        the last [sum(len - 1), D], for a draft that lost its cache. Runs on scratch cache entries
        (freed before returning): the requests' own cache and state are not touched."""
        if len({rid for rid, _ in items}) != len(items):
            raise ServiceError("INVALID_ARGUMENT", "request ids in one RecomputeRows must be unique")
        for rid, toks in items:
            r = self.requests.get(rid)
            if r is None:
                raise ServiceError("FAILED_PRECONDITION", f"request {rid!r} is not running on the target")
            if len(toks) != r.num_tokens or toks[-1] != r.pending_token:
                raise ServiceError("FAILED_PRECONDITION", f"request {rid!r}: token_ids has {len(toks)} tokens "
                                   f"ending in {toks[-1] if toks else None}, the target holds {r.num_tokens} "
                                   f"ending in {r.pending_token}")
            self._check_tokens(rid, "token_ids", toks)          # an id >= vocab indexed past the embedding
        scratch = {f"{rid}\0rows": toks[:-1] for rid, toks in items}    # >= 1 token each (num_tokens >= 2)
        if any(sid in self.cache for sid in scratch):
            raise ServiceError("ALREADY_EXISTS", "a request id of this RecomputeRows is taken by a running request")
        for sid in scratch:
            self.cache.allocate(sid)
        try:
            return self._forward(scratch)
        finally:
            for sid in scratch:
                self.cache.release(sid)

    def idle(self, seconds: float) -> list[str]:
        """The requests held that no Prefill or Verify named for `seconds`: their gateway is gone (it crashed, or its
        Release was lost), and nothing else would free their KV blocks."""
        since = time.monotonic() - seconds
        for rid in [rid for rid in self.named if rid not in self.requests and rid not in self.partial]:
            del self.named[rid]                     # a prefill that failed, or a request ended here
        return [rid for rid, t in self.named.items() if t < since]

    def release(self, ids: list[str]) -> int:
        n = 0
        for rid in ids:
            self.named.pop(rid, None)
            n += (self.requests.pop(rid, None) or self.partial.pop(rid, None)) is not None
            self.cache.release(rid)
        return n

    def _forward(self, seqs: dict[str, list[int]]) -> torch.Tensor:
        return self._run(self._prepare(seqs))

    def _prepare(self, seqs: dict[str, list[int]]):
        """Extend each request's cache by its tokens and lay the step out (all or nothing: RESOURCE_EXHAUSTED)."""
        try:
            return self.cache.prepare(list(seqs), [len(s) for s in seqs.values()], [t for s in seqs.values() for t in s])
        except CacheFullError as e:
            raise ServiceError("RESOURCE_EXHAUSTED", str(e)) from None

    def _run(self, batch) -> torch.Tensor:
        return expect_rows(self.forward(batch.input_ids, batch, self.cache), batch.num_tokens, "the target model")
