"""A step's inputs and outputs on the host (the target engine's, services/target/engine.py): what a Prefill and a
Verify return, the drafts laid out for the acceptance kernels, the draft distributions' checks, the sampling draws
and target distributions, and token logprobs."""
from __future__ import annotations

from array import array
from itertools import accumulate
from typing import NamedTuple

import torch

from infra.errors import ServiceError
from kernels.dispatch import sampling_probs
from kernels.noise import draw_keys, exp_noise, uniform
from services.sampling import Sampling, TopQ


class Prefilled(NamedTuple):
    first: list[int]                  # the first sampled token of each item (0 while it prefills in chunks)
    hidden: torch.Tensor              # final-norm rows of the prompt positions computed [sum T - cached, D]
    logprobs: list | None = None      # per item {"prompt": [T-1 entries], "first": entry or None}, if asked
    cached: list[int] | None = None   # per item: positions before this call's (prefix cache / earlier chunks)
    computed: list[int] | None = None # per item: positions in the cache after it (< len(prompt): chunked, no first)


class PrefillStep(NamedTuple):
    items: list                       # (request id, prompt, Sampling)
    logprobs: list | None
    spans: list[tuple[int, int]]      # per item the prompt positions computed now [start, end)
    seqs: dict[str, list[int]]        # their tokens, by request id
    new: list[str]                    # the requests this call starts (not continuing a chunked prompt)


class Verified(NamedTuple):
    accepted: list[int]               # accepted drafts per item
    emitted: list[list[int]]          # committed tokens per item (accepted drafts + the bonus/recovered one)
    rows: torch.Tensor                # hidden rows of the committed positions [sum(a + 1), D], or if pushed
    logprobs: list | None = None      # per item one entry per emitted token (empty lists where none asked)
    pushed: bool = False              # rows: every verified position's [sum(k + 1), D], on the bridge already


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[tuple[float, list[int], list[float]]]:
    """logits [M, V], tokens [M] -> per row (fp32 log-softmax of its token, top-n ids, their logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].cpu().tolist()
    if top_n <= 0:
        return [(v, [], []) for v in own]
    top = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
    return list(zip(own, top.indices.cpu().tolist(), top.values.cpu().tolist()))


def round_inputs(drafts: list[list[int]], dev):
    """A Verify's drafts -> host (k [B], starts: each request's first logit row) and device (drafts [B, K], k [B],
    idx [B, K+1]: b's logit rows), one transfer before the step, from Python lists (host work on its critical path)."""
    B, K = len(drafts), max(len(d) for d in drafts)
    k = [len(d) for d in drafts]
    starts = list(accumulate((n + 1 for n in k[:-1]), initial=0))
    last = sum(k) + B - 1                                                        # the last logit row
    flat = array("q", [t for d in drafts for t in (*d, *[0] * (K - len(d)))] + k)
    flat.extend(min(s + j, last) for s in starts for j in range(K + 1))
    p = torch.frombuffer(flat, dtype=torch.long).to(dev, non_blocking=True)
    return torch.tensor(k), starts, p[:B * K].view(B, K), p[B * K:B * K + B], p[B * K + B:].view(B, K + 1)


def check_q(rid: str, q, k: int, V: int) -> None:
    """A Verify item's draft distributions: k rows of finite non-negative probabilities over token ids < V."""
    if q is None:
        return
    if isinstance(q, TopQ):
        ok = (q.ids.shape == q.probs.shape and q.ids.shape[0] == k and q.ids.numel() > 0
              and bool(((q.ids >= 0) & (q.ids < V)).all()))
        if not ok:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: draft_top_ids must be {k} x w token ids "
                                                   f"below the vocabulary size {V}, as many as draft_top_probs")
        q, what = q.probs, "draft_top_probs"
    else:
        ok, what = q.shape == (k, V), "draft_probs"
        if not ok:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: draft_probs must be {k} x {V}")
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: {what} must be finite non-negative floats")


def draws(reqs: list, K: int, V: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled Verify's draws, keyed on the device (kernels/noise.py): a request's depend on its own seed and draw
    count only -> uniform [B, K], Exp(1) noise [B, V]. Greedy rows (one-hot p and q) get ones. Each request's draw
    count moves on by two."""
    B = len(reqs)
    sd = torch.tensor([[r.seed, r.draws, b] for b, r in enumerate(reqs) if not r.sampling.greedy])
    sd = sd.to(dev, non_blocking=True)                                         # [S, 3]
    u, e = torch.ones(B, K, device=dev), torch.ones(B, V, device=dev)
    u[sd[:, 2]] = uniform(draw_keys(sd[:, 0], sd[:, 1]), K).float()
    e[sd[:, 2]] = exp_noise(draw_keys(sd[:, 0], sd[:, 1] + 1), V)
    for r in reqs:
        r.draws += 2
    return u, e


def target_probs(logits: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """logits [M, V] -> target distributions [M, V], one Sampling per row."""
    t = torch.tensor([s.temperature for s in samplings], device=logits.device)
    tk = torch.tensor([s.top_k for s in samplings], device=logits.device)
    tp = torch.tensor([s.top_p for s in samplings], device=logits.device)
    return sampling_probs(logits, t, tk, tp, any(s.truncates for s in samplings))
