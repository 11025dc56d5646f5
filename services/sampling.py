"""One Sampling for both services: what a request asks of the sampler, read off the wire and checked once."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from infra.errors import ServiceError


STREAM_GAP = 0x9E3779B97F4A7C15         # between a request's random streams (an odd 64-bit constant)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0         # <= 0: greedy
    top_p: float = 0.0               # 0: off
    top_k: int = 0                   # 0: off
    seed: int | None = None          # None: a random stream

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def truncates(self) -> bool:
        """top-k or top-p cuts the distribution."""
        return 0 < self.top_k or 0 < self.top_p < 1

    @classmethod
    def from_pb(cls, rid: str, s) -> "Sampling":
        """A tandem.v1.SamplingParams, checked: temperature a finite number >= 0, top_p in [0, 1]."""
        for name, v, ok in (("temperature", s.temperature, math.isfinite(s.temperature) and s.temperature >= 0),
                            ("top_p", s.top_p, 0 <= s.top_p <= 1)):
            if not ok:
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: sampling.{name} is {v}, expected "
                                   + ("a finite number >= 0" if name == "temperature" else "a number in [0, 1]"))
        return cls(s.temperature, s.top_p, s.top_k, s.seed if s.HasField("seed") else None)

    def stream_seed(self, stream: int = 0) -> int:
        """A uint64 seed of the request's random stream `stream` (seed + stream x STREAM_GAP, wrapping at 2**64:
        target and draft draw apart, and no request's draft stream is another's target stream, as seed + 1
        would be for requests seeded 1, 2, 3 ...), or a random one for an unseeded request."""
        if self.seed is None:
            return int.from_bytes(os.urandom(8), "little")
        return (self.seed + stream * STREAM_GAP) % (1 << 64)

    def generator(self, stream: int = 0) -> torch.Generator:
        """The request's CPU generator on stream_seed(stream)."""
        seed = self.stream_seed(stream)
        return torch.Generator().manual_seed(seed >> 1 if self.seed is None else seed)


def noise_seed(s: Sampling, stream: int = 1) -> int:
    """A sampled request's noise seed (kernels/noise.py) as an int64: its seed on `stream` (the draft draws on
    1, the target on 0, so the two are independent) or a random one."""
    seed = s.stream_seed(stream)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class TopQ(NamedTuple):
    """A sampled draft's distributions at its k positions, sparse (kernels/noise.py top_mass): token ids [k, w]
    and their probabilities [k, w]; every other token has probability 0."""
    ids: torch.Tensor
    probs: torch.Tensor

    @classmethod
    def kept(cls, ids: torch.Tensor, probs: torch.Tensor) -> "TopQ":
        """ids, probs [k, W] as top_mass gives them -> the first w columns, w = the most any row kept."""
        w = max(int((probs > 0).sum(1).max()), 1) if probs.numel() else 1
        return cls(ids[:, :w].contiguous(), probs[:, :w].contiguous())

    def dense(self, vocab: int, device) -> torch.Tensor:
        """-> q [k, V] on `device`."""
        return torch.zeros(self.ids.shape[0], vocab, device=device).scatter_add_(
            1, self.ids.to(device, torch.long), self.probs.to(device, torch.float32))
