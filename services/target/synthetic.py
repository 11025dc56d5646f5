"""BENCHMARK ONLY: synthetic acceptance (`tandem target --synthetic-acceptance P`).

Random weights accept almost no draft, so a speedup cannot be measured on them. With P set, the
target still runs the real verify forward (its cost is real), then accepts each draft position
independently with probability P and stops at the first rejection: it emits the accepted drafts
and then its own greedy token at the first rejected position (the bonus token when all are
accepted), and rolls back exactly as for a real rejection. The output is not the model's.
Greedy requests only. Draws come from each request's seeded generator, so a seeded request
gives the same acceptance lengths on every run; mean acceptance length = (1 - P^(K+1)) / (1 - P).
"""
from __future__ import annotations

import torch


def synthetic_accept(target_ids: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor, p: float,
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1]: the target's greedy token at each verified position; drafts [B, K];
    k [B]: drafts per request -> accepted [B], emitted [B, K+1] (accepted drafts, then the target's
    token at the first rejected position; -1 beyond), all on the CPU."""
    target_ids, drafts = target_ids.cpu(), drafts.cpu()
    B, K1 = target_ids.shape
    accepted = torch.zeros(B, dtype=torch.long)
    emitted = torch.full((B, K1), -1, dtype=torch.long)
    for b, g in enumerate(generators):
        kb = int(k[b])
        u = torch.rand(kb, generator=g)                              # one draw per draft position
        rejected = (u >= p).nonzero()
        a = int(rejected[0]) if rejected.numel() else kb
        accepted[b] = a
        emitted[b, :a] = drafts[b, :a]
        emitted[b, a] = target_ids[b, a]
    return accepted, emitted


def expected_acceptance_length(p: float, k: int) -> float:
    """1 + E[accepted] with i.i.d. acceptance p per position, stopping at the first rejection."""
    return float(k + 1) if p >= 1 else (1 - p ** (k + 1)) / (1 - p)
