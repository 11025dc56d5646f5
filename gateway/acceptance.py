"""The adaptive policy's view of one request (gateway/adaptive.py): its acceptance counts by draft position,
fading with age, and the flags the policy keeps between rounds; and the round's best point along the batch's gain
path (best_path)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.spec_costs import CostModel


class Acceptance:
    """Decayed counts of draft positions reached and accepted (position 0 = the first draft)."""

    def __init__(self, decay: float):
        self.decay, self.reached, self.accepted = decay, [], []

    def add(self, k: int, accepted: int) -> None:
        """A round of k drafts accepted `accepted`: positions 0..min(accepted, k - 1) were reached."""
        grow = k - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(len(self.reached)):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(accepted + 1, k)):
            self.reached[i] += 1
        for i in range(min(accepted, k)):
            self.accepted[i] += 1

    def rate(self, i: int, prior: float, weight: float) -> float:
        if i >= len(self.reached):
            return prior
        return (self.accepted[i] + weight * prior) / (self.reached[i] + weight)


@dataclass
class RequestState:
    """The adaptive policy's view of one request (GenRequest.policy_state)."""
    acc: Acceptance
    greedy: bool
    seen: tuple[int, int] = (0, 0)   # r.stats (num_draft_tokens, num_accepted_tokens) at the last round
    idle: int = 0                    # rounds at k = 0 while synced
    shallow: int = 0                 # rounds at 0 < k < its cap in a row
    parked_at: int = 0               # the round it was last parked
    probing: bool = False            # woken for a probe: k >= 1 in its next speculating round


def best_path(gains: list[list[float]], forced: list[int], batch: int, rows0: int, costs: CostModel) -> list[int]:
    """gains[i][j]: probability that draft j + 1 of request i is accepted (falling in j); forced[i]: its
    least k. -> k of each request at the best point of the gain path (module docstring)."""
    ks = list(forced)
    tokens = batch + sum(sum(g[:f]) for g, f in zip(gains, forced))
    m, steps = sum(ks), max(ks, default=0)
    rest = sorted((-g, j, i) for i, gs in enumerate(gains) for j, g in enumerate(gs) if j >= forced[i])
    price = costs.pricer(batch)                     # rows0: a once-per-request cost, not the round's
    best_rate, best_m = tokens / max(price(m, steps), 1e-9), 0
    for n, (neg, j, _) in enumerate(rest, 1):
        tokens, m = tokens - neg, m + 1
        if j >= steps:
            steps = j + 1
        cost = price(m, steps)
        rate = tokens / (cost if cost > 1e-9 else 1e-9)
        if rate > best_rate:
            best_rate, best_m = rate, n
    for _, j, i in rest[:best_m]:
        ks[i] = max(ks[i], j + 1)
    return ks
