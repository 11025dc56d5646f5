"""One generation's state as the scheduler keeps it, the events it streams, its spec-decode counters
and the observer hooks (metrics) the scheduler calls."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from gateway.draft_state import DraftState
from gateway.text import TextStream
from tandem.v1 import rows_pb2


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Event:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None      # "stop" | "length" | None
    error: tuple[grpc.StatusCode, str] | None = None
    logprobs: list = field(default_factory=list)   # target_pb2.TokenLogprob per token, when asked


class Observer:
    """Hooks for metrics (gateway/metrics.py); the base does nothing."""

    def phase(self, name: str, seconds: float) -> None:
        """A phase outside the rounds took `seconds`: prefill, resync."""

    def round_split(self, seconds: dict[str, float]) -> None:
        """A whole round's split: round (wall), propose and verify (RPC walls), gateway (the rest), and
        the services' own transfer, draft_compute, target_compute (CallTiming)."""

    def tokens(self, r: "GenRequest", n: int, now: float) -> None:
        """`n` new tokens were committed for r (before r.first_token_time / last_token_time move)."""

    def finished(self, r: "GenRequest", reason: str | None, now: float) -> None:
        """r ended: "stop" | "length", or None (failed or cancelled)."""


@dataclass(eq=False)        # a request is itself: `in` and list.remove compare identity, not every field
class GenRequest:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: rows_pb2.SamplingParams
    text: TextStream
    ignore_eos: bool = False
    k: int = 0                                               # draft tokens per round
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    draft: DraftState = field(default_factory=DraftState)    # what the draft holds of it
    finished: bool = False
    cancelled: bool = False                                  # client gone while a call held it
    arrival: float = field(default_factory=time.monotonic)
    logprobs: int | None = None                              # top-n per output token; None: none
    prompt_logprobs: bool = False                            # score the prompt (echo + logprobs)
    prompt_lps: list = field(default_factory=list)           # TokenLogprob for prompt tokens 1..T-1
    span: object = None                                      # the client request's tracing span
    eos: tuple | None = None                                 # (EOS id, its TokenLogprob) when EOS ended it
    first_token_time: float | None = None
    last_token_time: float | None = None
    deadline: float | None = None                            # time.monotonic() by which the client gives up
    max_model_len: int = 1 << 30                             # the target's: prompt + output fit in it
    round_cap: int | None = None                             # this round's k, when a policy chose one
    policy_state: object = None                              # the speculation policy's (gateway/adaptive.py)
    cached_tokens: int = 0                                   # prompt positions the target's prefix cache held
    prefilled: int = 0                                       # prompt positions on the target (chunks so far)
    uncommitted: int = 0                                     # emitted by the last Verify, not yet committed
    preemptions: int = 0                                     # times the KV cache's room was taken back from it
    after: "GenRequest | None" = None                        # the copy of its prompt it waits for (chunking.py)

    @property
    def seeded_sampling(self) -> bool:
        """A seeded sampled request: its tokens depend on which drafts each round checks (the rejection rule's
        draws are its own, keyed on its seed and Verify count: kernels/noise.py), so a speculation policy gives
        it the same k every round (its cap), or the same seed would give other tokens. Greedy tokens do not
        depend on k; unseeded sampled ones are not meant to repeat."""
        return self.sampling.temperature > 0 and self.sampling.HasField("seed")

    @property
    def context_ids(self) -> list[int]:
        """What its Prefill computes: the prompt, and after a preemption the output so far (recomputed)."""
        return self.prompt_ids + self.output_ids if self.preemptions else self.prompt_ids

    def take(self, tokens: list[int], logprobs: list | None, eos: set[int]) -> tuple[list[int], str, str | None]:
        """Append the target's tokens to the output up to the first that ends the request (EOS, one that
        completes a stop string, max_tokens) -> (tokens taken, their text, finish reason or None). The round's
        tokens are detokenized together; only when a stop string ends them are they replayed one by one, to
        find the token that completed it."""
        new, finish, end = [], None, None
        for i, t in enumerate(tokens):
            if not self.ignore_eos and t in eos:
                finish, end = "stop", (t, logprobs[i] if logprobs and i < len(logprobs) else None)
                break
            new.append(t)
            if len(self.output_ids) + len(new) >= self.max_tokens:
                finish = "length"
                break
        mark = self.text.mark()
        text, stopped = self.text.add(new) if new else ("", False)
        if stopped and len(new) > 1:
            self.text.restore(mark)
            text, taken, stopped = "", 0, False
            while not stopped and taken < len(new):
                delta, stopped = self.text.add([new[taken]])
                text, taken = text + delta, taken + 1
            new = new[:taken]
        if stopped:
            finish = "stop"
        elif end is not None:
            self.eos = end
        self.output_ids += new
        if finish and not stopped:
            text += self.text.flush()
        return new, text, finish

    @property
    def ends_at_commit(self) -> bool:
        """The last Verify's tokens, once committed, reach max_tokens or the end of the context: no next round."""
        n = len(self.output_ids) + self.uncommitted
        return n >= self.max_tokens or len(self.prompt_ids) + n >= self.max_model_len

    def round_k(self, k: int | None = None) -> int:
        """Drafts this round: k (default: the speculation policy's choice for this round, else K), less near
        the end of the context (the target holds at most max_model_len positions; a round planned before the
        last Verify's tokens are committed counts them). Near max_tokens a round still drafts k (the tokens
        past it are dropped), so acceptance figures stay comparable across requests."""
        if k is None:
            k = self.k if self.round_cap is None else self.round_cap
        held = len(self.prompt_ids) + len(self.output_ids) + self.uncommitted
        return max(0, min(k, self.max_model_len - held))


def call_budget(reqs: list[GenRequest], cap: float) -> tuple[float, bool]:
    """-> (timeout of a call over reqs, whether their deadlines set it): nobody waits past the
    last of their deadlines, so the call need not either."""
    if not reqs or any(r.deadline is None for r in reqs):
        return cap, False
    left = max(r.deadline for r in reqs) - time.monotonic()
    return (max(0.05, left), True) if left < cap else (cap, False)
