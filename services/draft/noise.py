"""The draft's sampling noise as a pure function of (request seed, draw index, token id): no generator state.

A sampled draft token is argmax_v q[v] / E[v] with E[v] i.i.d. Exp(1) (exactly a draw from q). The draft
draws E from a counter-based hash instead of a stateful generator, so the same draws come out whether a
round's steps run one at a time on the host (DraftEngine's loop) or all in one CUDA graph (chain.py), and a
seeded request's drafts depend only on its own history: its seed and how many tokens it has drafted so far
(draw index), never on its batch-mates. Each draft token takes a fresh draw index, so no noise vector is
used twice for a request (reusing one after a rejection would tie the new draft to the rejected one).

The hash is SplitMix64's finalizer on int64 tensors (wrapping multiplication; logical right shifts by
masking), 53 bits of it as a uniform in (0, 1); everything stays on the device, so it can be captured.
"""
from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687              # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685              # 0x94D049BB133111EB
_STRIDE = 0x632BE59BD9B4E019            # separates the (seed, draw) keys


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)            # logical shift of int64


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def draw_keys(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """seeds [M] int64, draws [M] int64 (the request's draw index) -> keys [M] int64."""
    return _mix(seeds * _GOLDEN + draws * _STRIDE)


def exp_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [M] int64 -> Exp(1) noise [M, V] float32, E[m, v] a function of (keys[m], v) only."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.long)
    z = _mix(keys[:, None] + v[None, :] * _GOLDEN)                              # [M, V]
    u = (_shr(z, 11).double() + 0.5) * (1.0 / (1 << 53))                         # (0, 1)
    return (-torch.log(u)).float()


def choose(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [M, V] distributions -> tokens [M] int64, each a draw from its row (a one-hot row gives its token)."""
    return (q / exp_noise(keys, q.shape[-1])).argmax(-1)
