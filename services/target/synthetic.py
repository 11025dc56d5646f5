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
    rejected position; -1 beyond), all on the CPU: synthetic_counts, then synthetic_emitted."""
    accepted = torch.from_numpy(synthetic_counts(k, drafts.shape[1], profile, states))
    return accepted, synthetic_emitted(target_ids.cpu(), drafts.cpu(), accepted)


def synthetic_counts(k: torch.Tensor, K: int, profile: tuple[float, ...], states: list[list[int]]) -> np.ndarray:
    """Each request's accepted count [B] int64 (one draw of each state taken), known before the Verify's forward
    runs: position j of request b is accepted when uniform(draw_keys(seed_b, draw_b), K)[j] < P_j (kernels/noise.py,
    on the host), a function of (seed, draw, j) only, and j < k[b]."""
    seeds, draws = [st[0] for st in states], [st[1] for st in states]
    for st in states:
        st[1] += 1
    p = np.array([profile[min(i, len(profile) - 1)] for i in range(K)])                     # [K]
    rejected = (host_uniform(seeds, draws, K) >= p) | (np.arange(K)[None, :] >= k.cpu().numpy()[:, None])
    return np.where(rejected.any(1), rejected.argmax(1), K).astype(np.int64)    # first rejected position (else all)


def synthetic_emitted(target_ids: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """target_ids [B, K+1], drafts [B, K], accepted [B] (all on one device) -> emitted [B, K+1] int64 there: the
    accepted drafts, the target's token at the first rejected position, -1 beyond (as a real Verify's)."""
    B, K1 = target_ids.shape
    pos, a = torch.arange(K1, device=target_ids.device)[None, :], accepted.long()[:, None]
    own = torch.cat([drafts.long(), drafts.new_full((B, 1), -1).long()], 1)              # [B, K+1]
    return torch.where(pos < a, own, torch.where(pos == a, target_ids.long(), torch.full_like(own, -1)))


def expected_acceptance_length(profile: tuple[float, ...], k: int) -> float:
    """1 + E[accepted]: position i is reached with probability P_1 ... P_i (stopping at the first rejection)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= profile[min(i, len(profile) - 1)]
        total += reach
    return total
