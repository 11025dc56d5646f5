"""One Sampling for both services: what a request asks of the sampler, read off the wire and checked once."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from infra.errors import ServiceError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0         # <= 0: greedy
    top_p: float = 0.0               # 0: off
    top_k: int = 0                   # 0: off
    seed: int | None = None          # None: a random stream

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

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
        """A uint64 seed of the request's random stream `stream` (seed + stream, so target and draft draw
        apart; wraps at 2**64), or a random one for an unseeded request."""
        return (self.seed + stream) % (1 << 64) if self.seed is not None else int.from_bytes(os.urandom(8), "little")

    def generator(self, stream: int = 0) -> torch.Generator:
        """The request's CPU generator on stream_seed(stream)."""
        seed = self.stream_seed(stream)
        return torch.Generator().manual_seed(seed >> 1 if self.seed is None else seed)


def noise_seed(s: Sampling) -> int:
    """The draft's noise key of a sampled request (services/draft/noise.py): its seed (apart from the target's
    streams) or a random one; an int64."""
    seed = s.stream_seed(1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed
