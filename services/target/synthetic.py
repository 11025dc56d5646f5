"""BENCHMARK ONLY: synthetic acceptance (`tandem target --synthetic-acceptance P` or `P1,P2,...`).

Random weights accept almost no draft, so a speedup cannot be measured on them. With a profile set, the
target still runs the real verify forward (its cost is real), then accepts draft position i with
probability P_i given that position i - 1 was accepted (positions past the profile use its last value;
one value: the same at every position) and stops at the first rejection: it emits the accepted drafts
and then its own greedy token at the first rejected position (the bonus token when all are accepted),
and rolls back exactly as for a real rejection. The output is not the model's. Greedy requests only.
Draws come from each request's seeded generator, so a seeded request gives the same acceptance lengths
on every run; mean acceptance length = 1 + sum over i <= K of P_1 ... P_i.

Two profiles are worth measuring: a constant 0.85, and one like published DeepSeek-R1 MTP runs
(TensorRT-LLM: accept lengths 1.92 / 2.58 / 2.82 with 1 / 2 / 3 drafts, i.e. 0.92,0.72,0.36).
"""
from __future__ import annotations

import torch

R1_LIKE = (0.92, 0.72, 0.36)            # conditional acceptance by position, DeepSeek-R1 MTP (above)


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
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1]: the target's greedy token at each verified position; drafts [B, K];
    k [B]: drafts per request -> accepted [B], emitted [B, K+1] (accepted drafts, then the target's
    token at the first rejected position; -1 beyond), all on the CPU. One draw a draft position from each
    request's generator; the rest is whole-batch tensor work (a batch-32 Verify spent ~1 ms in a loop here)."""
    target_ids, drafts = target_ids.cpu(), drafts.cpu()
    B, K1 = target_ids.shape
    p = torch.tensor([profile[min(i, len(profile) - 1)] for i in range(K1 - 1)])   # [K]
    u = torch.ones(B, K1 - 1)                                       # past a request's drafts: rejected (p <= 1)
    for b, (g, kb) in enumerate(zip(generators, k.tolist())):
        if kb:
            u[b, :kb] = torch.rand(kb, generator=g)
    rejected = torch.cat([u >= p, torch.ones(B, 1, dtype=torch.bool)], 1)           # [B, K+1]
    accepted = rejected.to(torch.int8).argmax(1)                                   # first rejected position
    pos = torch.arange(K1)[None, :]
    a = accepted[:, None]
    own = torch.cat([drafts, torch.full((B, 1), -1, dtype=drafts.dtype)], 1)      # [B, K+1]
    emitted = torch.where(pos < a, own, torch.where(pos == a, target_ids, -1)).long()
    return accepted.long(), emitted


def expected_acceptance_length(profile: tuple[float, ...], k: int) -> float:
    """1 + E[accepted]: position i is reached with probability P_1 ... P_i (stopping at the first rejection)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= profile[min(i, len(profile) - 1)]
        total += reach
    return total
