"""Sampling noise as a pure function of (request seed, draw index, position): no generator state.

Both services draw their randomness here, on the device that holds the logits, and no draw depends on a
request's batch-mates: a seeded request's output depends only on its own seed and history.

- The draft: a sampled draft token is argmax_v q[v] / E[v] with E[v] i.i.d. Exp(1) (exactly a draw from
  q). Each draft token takes a fresh draw index (never a noise vector twice: reusing one after a rejection
  would tie the new draft to the rejected one), so the same draws come out whether a round's steps run one
  at a time on the host (DraftEngine's loop) or all in one CUDA graph (chain.py).
- The target (services/target/engine.py): draw 0 samples the first token after prefill; each sampled
  Verify then takes two, the uniforms of its acceptance tests (position j: a function of j only, not of how
  many drafts the round had) and the Exp(1) noise of its residual or bonus token. The target's seed is
  another stream of the request's seed than the draft's (services/sampling.py), so the two are independent:
  the acceptance test must not see the noise that chose the draft.

The hash is SplitMix64's finalizer on int64 tensors (wrapping multiplication; logical right shifts by
masking), 53 bits of it as a uniform in (0, 1); everything stays on the device, so it can be captured.
"""
from __future__ import annotations

import numpy as np
import torch

_GOLDEN = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687              # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685              # 0x94D049BB133111EB
_STRIDE = 0x632BE59BD9B4E019            # separates the (seed, draw) keys
_U = [np.uint64(x % (1 << 64)) for x in (_GOLDEN, _STRIDE, _M1, _M2)]     # the same as uint64 (host_uniform)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer, in place on z (a fresh tensor: noise vectors are [M, V], allocations count)."""
    for shift, mul in ((30, _M1), (27, _M2), (31, 0)):
        t = z >> shift
        t &= (1 << (64 - shift)) - 1
        z ^= t
        if mul:
            z *= mul
    return z


def draw_keys(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """seeds [M] int64, draws [M] int64 (the request's draw index) -> keys [M] int64."""
    return _mix(seeds * _GOLDEN + draws * _STRIDE)


def uniform(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [M] int64 -> U(0, 1) [M, n] float64, U[m, j] a function of (keys[m], j) only."""
    j = torch.arange(n, device=keys.device, dtype=torch.long) * _GOLDEN
    z = _mix(keys[:, None] + j[None, :])                                        # [M, n]
    z >>= 11
    z &= (1 << 53) - 1
    return z.double().add_(0.5).mul_(1.0 / (1 << 53))


def host_uniform(seeds: list[int], draws: list[int], n: int) -> np.ndarray:
    """uniform(draw_keys(seeds, draws), n) computed on the host with numpy (the same bits; wrapping uint64
    arithmetic): [M, n] float64, ~4x faster than torch's op-by-op dispatch for a batch's few values."""
    with np.errstate(over="ignore"):
        s = np.array(seeds, dtype=np.int64).view(np.uint64)
        d = np.array(draws, dtype=np.int64).view(np.uint64)
        z = _np_mix(_np_mix(s * _U[0] + d * _U[1])[:, None] + np.arange(n, dtype=np.uint64)[None, :] * _U[0])
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _np_mix(z: np.ndarray) -> np.ndarray:
    """_mix on uint64 arrays (shifts are logical there)."""
    for shift, mul in ((30, _U[2]), (27, _U[3]), (31, None)):
        z ^= z >> np.uint64(shift)
        if mul is not None:
            z *= mul
    return z


def exp_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [M] int64 -> Exp(1) noise [M, V] float32, E[m, v] a function of (keys[m], v) only."""
    return uniform(keys, vocab).log_().neg_().float()


def top_mass(q: torch.Tensor, mass: float, width: int):
    """q [M, V] -> (q' [M, V], ids [M, w], probs [M, w], whole [M] bool), w = min(width, V): each row restricted to
    its most probable tokens, the fewest whose mass reaches `mass` (at least one), renormalized; ids by falling
    probability, probs 0 past the kept ones (a prefix of each row). A row whose w most probable tokens do not reach
    `mass` (a flat distribution) is left whole: q' = q there, `whole` says so, and its ids / probs are not q'.
    Speculative sampling stays exact for any distribution the draft samples from, so a draft that samples from q'
    may send q' as w entries a row instead of V (whole rows: V); acceptance loses at most 1 - mass a position
    (sum of min(p, q') >= sum of min(p, q) - (1 - kept mass))."""
    probs, ids = q.topk(min(width, q.shape[-1]), dim=-1)                        # [M, w], falling
    keep = probs.cumsum(-1) - probs < mass                                      # the mass above is short of it
    whole = keep[:, -1] & (probs.shape[-1] < q.shape[-1])                       # the width bound before the mass
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    cut = torch.zeros_like(q).scatter_(-1, ids, probs)
    return torch.where(whole[:, None], q, cut), ids, probs, whole


def choose(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [M, V] distributions -> tokens [M] int64, each a draw from its row (a one-hot row gives its token)."""
    return (q / exp_noise(keys, q.shape[-1])).argmax(-1)
