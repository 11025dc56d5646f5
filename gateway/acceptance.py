"""The adaptive policy's view of one request (gateway/adaptive.py): its acceptance counts by draft position,
fading with age, and the flags the policy keeps between rounds."""
from __future__ import annotations

from dataclasses import dataclass


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
