"""What the draft holds for one request, as the gateway tracks it, and the only ways it changes.

The draft's cache of a request is derived state: the committed tokens it was given (from `position`
on) and the target's hidden rows for them. The gateway keeps the tokens not yet given to it and the
row set that holds their rows, and these flags:

- `speculate`: the draft holds the request's state and proposes for it each round;
- `stale`: the request wants drafts but the draft's cache of it is lost or unknown, so it decodes
  without drafts until gateway/resync.py rebuilds that cache;
- `parked`: the speculation policy (gateway/adaptive.py) stopped sending it to the draft, whose cache of
  it falls behind; it decodes without drafts until the policy wakes it (then it is stale: re-synced);
- `prompt_only`: it wants no drafts (k = 0), but the draft is given its prompt once (prefill chunks, no
  drafts asked), so that the draft's prefix cache holds what the target's does: a later request sharing the
  prefix finds it on both sides (else its first round would wait on a recovery: gateway/prefix_recovery.py).
  Set by `prefilled`, ended by `prompt_given` or `lost`; the draft then falls behind on it, as on a parked one.

Transitions (each a method below): `prefilled` (after Prefill), `proposed` (a Propose took the
pending tokens), `verified` (a Verify committed tokens + rows), `lost` (the draft failed: stale),
`resynced` (its cache was rebuilt), `dropped` (re-sync gave up: the request finishes without drafts),
`park` (no Propose for it this round, by choice) and `wake` (the policy wants drafts again: stale).
`probe` marks a stale request the policy woke, so gateway/resync.py does not count it as a fault.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.v1 import rows_pb2


@dataclass
class DraftState:
    speculate: bool = False                                   # before Prefill the draft holds nothing
    stale: bool = False
    pending: list[int] = field(default_factory=list)          # committed, not yet given to the draft
    position: int = 0                                         # the index of pending[0] in the request
    rows: rows_pb2.HiddenRows | None = None                   # the row set holding the pending tokens' rows
    parked: bool = False
    probe: bool = False                                       # stale because the policy woke it
    cached: int = 0                                           # new request: leading positions sent without rows
    prompt_only: bool = False

    @property
    def to_draft(self) -> bool:
        """Its pending tokens go to the draft: it speculates, or its prompt is still being given (prompt_only)."""
        return self.speculate or self.prompt_only

    def prefilled(self, tokens: list[int], rows: rows_pb2.HiddenRows, speculate: bool, wants_drafts: bool,
                  cached: int = 0) -> None:
        """After Prefill: the draft gets `tokens` (prompt + first token) from position 0 with Prefill's
        rows, which skip the first `cached` positions (the target's prefix cache held them; the draft
        takes them from its own, or answers not_held). A request that wants drafts but cannot have them
        now (speculation degraded, no rows) starts stale, so it is re-synced once the draft is back."""
        self.speculate, self.stale = speculate and wants_drafts, wants_drafts and not speculate
        self.prompt_only = speculate and not wants_drafts
        self.pending, self.position, self.rows, self.cached = list(tokens), 0, rows, cached

    def proposed(self) -> None:
        """A Propose took the pending tokens and their rows: the draft holds them now."""
        self.position += len(self.pending)
        self.pending, self.rows, self.cached = [], None, 0

    def verified(self, tokens: list[int], rows: rows_pb2.HiddenRows) -> None:
        """A Verify committed `tokens`: they and their rows go to the draft with the next Propose, while
        it still speculates for this request (a stale one is rebuilt from all committed tokens)."""
        if self.speculate or self.prompt_only and not self.pending:    # (a prompt not yet given stays pending)
            self.pending, self.rows = list(tokens), rows

    def prompt_given(self) -> None:
        """A prompt-only request's whole prompt (and first token) reached the draft: no more of it goes there."""
        self.prompt_only = False

    def lost(self) -> None:
        """The draft failed or its state of this request is unknown: decode without drafts, re-sync later."""
        self.prompt_only = False
        if self.speculate:
            self.speculate, self.stale = False, True

    def resynced(self, tokens: list[int], rows: rows_pb2.HiddenRows) -> None:
        """The draft dropped what it held and the target recomputed rows of every committed token but
        the last: the next Propose gives it all of `tokens` from position 0, as a new request."""
        self.speculate, self.stale, self.probe = True, False, False
        self.pending, self.position, self.rows, self.cached = list(tokens), 0, rows, 0

    def dropped(self) -> None:
        """Re-sync gave up (no room for it on the target): the request finishes without drafts."""
        self.speculate, self.stale = False, False

    def park(self) -> None:
        """The policy sends it no Propose this round: the draft falls behind on it until `wake`."""
        if self.speculate:
            self.speculate, self.parked = False, True

    def wake(self) -> None:
        """The policy wants drafts for a parked request again: re-sync it (gateway/resync.py) first."""
        if self.parked:
            self.parked, self.stale, self.probe = False, True, True
