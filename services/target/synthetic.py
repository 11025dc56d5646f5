"""BENCHMARK ONLY: synthetic acceptance (`tandem target --synthetic-acceptance P` or `P1,P2,...`).

Random weights accept almost no draft, so a speedup cannot be measured on them. With a profile set, the
target still runs the real verify forward (its cost is real), then accepts draft position i with
probability P_i given that position i - 1 was accepted (positions past the profile use its last value;
one value: the same at every position) and stops at the first rejection: it emits the accepted drafts
and then its own greedy token at the first rejected position (the bonus token when all are accepted),
and rolls back exactly as for a real rejection. The output is not the model's. Greedy requests only.
Each Verify takes one draw of the request's keyed noise (kernels/noise.py: a function of its seed and its
Verify count, on a stream of its own), so a seeded request gives the same acceptance lengths on every run
and in any batch; mean acceptance length = 1 + sum over i <= K of P_1 ... P_i. The draws are whole-batch
array work on the host (numpy): this runs between the Verify's device work and the next round's Propose, a cost
real acceptance does not have (one torch.Generator draw a request took ~0.1 ms of a batch-32 round).

Two profiles are worth measuring: a constant 0.85, and one like published DeepSeek-R1 MTP runs
(TensorRT-LLM: accept lengths 1.92 / 2.58 / 2.82 with 1 / 2 / 3 drafts, i.e. 0.92,0.72,0.36).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.noise import host_uniform

R1_LIKE = (0.92, 0.72, 0.36)            # conditional acceptance by position, DeepSeek-R1 MTP (above)
STREAM = 2                              # the requests' seed stream of these draws (services/sampling.py)


def parse_profile(text: str | float | None) -> tuple[float, ...] | None:
    """'0.85' or '0.92,0.72,0.36' -> the profile; '' or a negative value -> None (off)."""
    if text is None or str(text).strip() == "":
        return None
    vals = tuple(float(x) for x in str(text).split(","))
    if len(vals) == 1 and vals[0] < 0:
        return None
    if not all(0 <= v <= 1 for v in vals):
        raise ValueError(f"--synthetic-acceptance: every probability must be in [0, 1], got {text}")
    return vals


def synthetic_accept(target_ids: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor, profile: tuple[float, ...],
                     states: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1]: the target's greedy token at each verified position; drafts [B, K];
    k [B]: drafts per request; states: each request's [synthetic seed (int64), draws taken (its Verifies so far)],
    one draw taken here -> accepted [B], emitted [B, K+1] (accepted drafts, then the target's token at the first
    rejected position; -1 beyond), all on the CPU. Position j of request b is accepted when
    uniform(draw_keys(seed_b, draw_b), K)[j] < P_j (kernels/noise.py, on the host): a function of (seed, draw, j)
    only."""
    seeds, draws = [st[0] for st in states], [st[1] for st in states]
    for st in states:
        st[1] += 1
    target, own = target_ids.cpu().numpy(), drafts.cpu().numpy()
    B, K1 = target.shape
    p = np.array([profile[min(i, len(profile) - 1)] for i in range(K1 - 1)])                 # [K]
    rejected = (host_uniform(seeds, draws, K1 - 1) >= p) | (np.arange(K1 - 1)[None, :] >= k.cpu().numpy()[:, None])
    accepted = np.where(rejected.any(1), rejected.argmax(1), K1 - 1)           # first rejected position (else all)
    pos, a = np.arange(K1)[None, :], accepted[:, None]
    own = np.concatenate([own, np.full((B, 1), -1, dtype=own.dtype)], 1)      # [B, K+1]
    emitted = np.where(pos < a, own, np.where(pos == a, target, -1))
    return torch.from_numpy(accepted.astype(np.int64)), torch.from_numpy(emitted.astype(np.int64))


def expected_acceptance_length(profile: tuple[float, ...], k: int) -> float:
    """1 + E[accepted]: position i is reached with probability P_1 ... P_i (stopping at the first rejection)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= profile[min(i, len(profile) - 1)]
        total += reach
    return total
