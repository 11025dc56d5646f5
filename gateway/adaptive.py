"""Speculation policies: how many draft tokens each request gets in the next round (`--speculation`).

fixed: every request the draft speculates for drafts its K each round (the gateway's -k, or the request's
num_speculative_tokens), as before this module.

adaptive: each round, every request's k in 0 .. its cap (that K) is chosen to maximise the batch's
expected committed tokens per second.

- Acceptance. Draft j of request r is accepted with probability p_r(j) = a_r1 ... a_rj, a_ri the
  conditional acceptance at position i (given i - 1 was accepted). With k drafts a round commits
  E[n_r(k)] = 1 + sum_{j<=k} p_r(j) tokens (the accepted drafts and the target's own token). a_ri is
  estimated from the request's rounds (reached / accepted counts at each position, fading by
  REQUEST_DECAY a round) shrunk towards its class's figure (greedy or sampled: the live counters of all
  requests of that class, themselves starting from DEFAULT_PRIOR) with PRIOR_WEIGHT pseudo-rounds. Until a
  position has been reached PRIOR_WEIGHT times the request is not priced below its class there: in the CPU
  replay (tests/test_adaptive_replay.py) one early failure moved a new request from 0.85 to 0.73 and parked it
  for its life (parked, it gathers no evidence) where its class and its truth had drafting pay.
- Cost. C(k) = gateway + verify_B(B + m) + [m > 0] propose(max k, m), m = sum of k, B requests:
  gateway/spec_costs.py, the measured phase times of past rounds of that shape (medians, so one slow round
  does not decide). The first Propose of a request (the draft catching up on its prompt) is paid once per
  request whatever its k, so it is not charged to the round that happens to carry it.
- Choice. Maximise R(k) = sum_r E[n_r(k_r)] / C(k). Since p_r(j) falls with j, one order serves the
  batch: sort every (r, j) by p_r(j); k(m) takes the first m. Along that path the tokens grow by ever
  smaller steps while C(m) grows by about a token's price (plus an MTP step at each new depth, plus the
  Propose at m = 1); R is evaluated at every m (O(M log M), M = sum of caps) and the best kept: whole k are
  compared, each with the Propose's fixed cost counted once, so a fixed cost is paid only when enough gain
  follows it. A draft token is worth taking while p > R * dC/dm: where a verify token is nearly free, deep
  drafts of likely requests pay; at batch 1 on a machine where a draft step costs half a verify, none may.
  Equal estimates get equal k (ties go to the shallower draft first). TANDEM_LOG_LEVEL=DEBUG logs
  each round's choice, prices and estimates, then its outcome. A request prefilled after its round was planned
  (its first Propose rides on a Propose sent ahead) drafts 0 in it: the next plan gives it a k. Seeded sampled
  requests draft their cap in every round (GenRequest.seeded_sampling), so that a seed repeats its tokens.
- Depth. A request held at 0 < k < its cap for SYNC_PROBE rounds drafts k + 1 once, so the figure of the
  position past its k is measured, not left at a few early failures (a bandit's exploration). Every request
  then at 0 < k < its cap goes one deeper in that same round: the deeper MTP step is paid by the whole batch
  (on a 2-core CPU ~15 ms at batch 8, a third of the round), so probes one request at a time, staggered,
  paid it in nearly every round.
- Zero. A request at k = 0 while others draft still goes to the draft with 0 drafts (it catches up on
  its committed tokens, so it may draft next round); every SYNC_PROBE rounds it is probed with k = 1.
  When no request drafts, the round skips the Propose and its requests are parked (DraftState.park):
  they decode at the cost of K = 0. Every reprobe interval the longest-parked request is woken: it is
  re-synced (gateway/resync.py) and probed with k = 1. The interval is `--adaptive-reprobe-rounds`,
  or by default as often as PROBE_BUDGET of the round time allows at the measured cost of a re-sync; a request
  whose re-sync that budget does not pay for within MAX_REPROBE rounds stays parked (a long context on a CPU: a
  re-sync of 2,000 tokens stalled every stream ~10 s, every 1,024 rounds).
- Start-up. The first START_CYCLES * (cap + 1) rounds of each batch bucket with synced requests draft
  k = cap, cap - 1, .., 0 in turn (k = 0: a Propose of no drafts, so nobody is parked), so every whole k
  is measured START_CYCLES times (a median: a shape's slow first call does not decide) before the policy
  decides. After the first bucket's, a bucket's start-up waits until the batch has stayed in it SETTLE rounds
  in a row: a batch passing through (a tail of finishing requests) is priced off the measured buckets' lines
  (a Propose even when it drafts nothing, so nobody is parked before that bucket has been measured). A bucket where no round drafted for REFRESH rounds drafts its synced requests' cap once, so
  costs that moved are seen again; parked requests keep being probed. A bucket that drafted in every round
  for PLAIN_EVERY rounds (the batch staying in it), or that has stayed PLAIN_RUN + 1 rounds with no plain
  shape measured TRUST times, runs PLAIN_RUN rounds of k = 0 (with a Propose of no drafts, so nobody is parked):
  k = 0 is priced by plain rounds only (gateway/spec_costs.py), and those measure it as it costs now.
"""
from __future__ import annotations

import logging

from gateway.acceptance import Acceptance, RequestState, best_path
from gateway.request import GenRequest
from gateway.spec_costs import CostModel, bucket

log = logging.getLogger("tandem.adaptive")   # DEBUG: each round's choice and outcome

DEFAULT_PRIOR = (0.8, 0.7, 0.6)   # conditional acceptance by position before any round (the last repeats)
CLASS_WEIGHT = 2.0                # pseudo-rounds of DEFAULT_PRIOR in a class's figure
PRIOR_WEIGHT = 6                # pseudo-rounds of its class's figure in a request's estimate
REQUEST_DECAY = 0.95               # a request's evidence fades by this each round it drafts
CLASS_DECAY = 0.998               # a class's, each request-round that drafts
SYNC_PROBE = 8                    # rounds a request stays at k = 0 beside drafting ones before a k = 1 probe
START_CYCLES = 3                  # start-up rounds per batch bucket: this many of each k in cap .. 0
SETTLE = 16                       # rounds a batch stays in a bucket before its start-up (after the first)
REFRESH = 512                     # rounds of a bucket without drafts before one round drafts the cap again
PLAIN_EVERY = 128                 # rounds in a bucket, drafting in every one, before PLAIN_RUN rounds without
PLAIN_RUN = 3                     # (a Propose of no drafts: nobody parked), so k = 0 is priced as it is now
PROBE_BUDGET = 0.01               # default re-probing of parked requests: this share of the round time
MIN_REPROBE = 16                  # rounds, at least, between two wakes (default interval)
MAX_REPROBE = 1024                # rounds, at most (256 capped the budget: at batch 1 on the H200 a probe cost ~2 %)


class FixedPolicy:
    """Each speculating request drafts its own K (GenRequest.round_k); also the counters both export."""
    name = "fixed"

    def __init__(self, cap: int = 0):
        self.cap = cap
        self.k_counts = [0] * (cap + 1)     # request-rounds by the k they drafted (tandem:spec_decode_chosen_k)
        self.parks = self.wakes = 0

    def plan(self, batch: list[GenRequest]) -> list[GenRequest]:
        """Before a round: the requests to send to the draft (their k: r.round_k())."""
        return [r for r in batch if r.draft.speculate]

    def observe(self, batch: list[GenRequest], split: dict[str, float]) -> None:
        """After a round: its requests (r.stats counted their drafts) and its split (seconds by phase)."""

    def resynced(self, tokens: int, seconds: float) -> None:
        """A re-sync (gateway/resync.py) recomputed `tokens` committed tokens in `seconds`."""

    def joining(self, reqs: list[GenRequest]) -> None:
        """Requests prefilled after this round was planned, proposed for with it: at their own K (fixed)."""

    def record(self, ks: list[int]) -> None:
        """A Verify checked these draft counts, one per request of its round (the scheduler calls this once
        a round, with what each request got: a request the round did not propose for counts at 0)."""
        for k in ks:
            if k >= len(self.k_counts):
                self.k_counts += [0] * (k + 1 - len(self.k_counts))
            self.k_counts[k] += 1

    def estimate(self, r: GenRequest) -> list[float]:
        """r's conditional acceptance by position (as measured; the adaptive policy: as it estimates it)."""
        s, out, reached = r.stats, [], r.stats.num_drafts
        for a in s.accepted_per_position:
            if reached <= 0:
                break
            out.append(a / reached)
            reached = a
        return out


class AdaptivePolicy(FixedPolicy):
    """Per request and round k chosen from live acceptance estimates and measured costs (module docstring)."""
    name = "adaptive"

    def __init__(self, cap: int, reprobe_rounds: int = 0):
        super().__init__(cap)
        self.reprobe_rounds = reprobe_rounds            # 0: from PROBE_BUDGET and the measured costs
        self.costs = CostModel()
        self.classes = {True: Acceptance(CLASS_DECAY), False: Acceptance(CLASS_DECAY)}   # greedy -> counts
        self.round = 0
        self.next_wake = 0
        self.started: dict[int, int] = {}               # batch bucket -> start-up rounds run
        self.stay = (-1, 0)                             # the last round's bucket, rounds in it in a row
        self.drafted: dict[int, int] = {}               # batch bucket -> the last round that drafted
        self.plain_run = 0                              # plain rounds left to run (PLAIN_EVERY)
        self._last: tuple | None = None                 # the plan of the round in flight

    def state(self, r: GenRequest) -> RequestState:
        if r.policy_state is None:
            r.policy_state = RequestState(Acceptance(REQUEST_DECAY), r.sampling.temperature == 0)
        return r.policy_state

    def class_rate(self, greedy: bool, i: int) -> float:
        return self.classes[greedy].rate(i, DEFAULT_PRIOR[min(i, len(DEFAULT_PRIOR) - 1)], CLASS_WEIGHT)

    def gains(self, r: GenRequest, cap: int, priors: dict[bool, list[float]]) -> list[float]:
        """p_r(1..cap): the probability that each draft position is accepted (priors: the class rates by
        position, computed once a round)."""
        st, out, p = self.state(r), [], 1.0
        acc, prior = st.acc, priors[st.greedy]
        for i in range(cap):
            a = acc.rate(i, prior[i], PRIOR_WEIGHT)
            if i >= len(acc.reached) or acc.reached[i] < PRIOR_WEIGHT:     # a few failures prove nothing yet
                a = max(a, prior[i])
            p *= a
            out.append(p)
        return out

    def estimate(self, r: GenRequest) -> list[float]:
        if (st := r.policy_state) is None or not st.acc.reached:
            return []
        return [st.acc.rate(i, self.class_rate(st.greedy, i), PRIOR_WEIGHT) for i in range(len(st.acc.reached))]

    # --- the round ------------------------------------------------------------------------------------
    def plan(self, batch: list[GenRequest]) -> list[GenRequest]:
        self.round += 1
        b = bucket(len(batch))
        self.stay = (b, self.stay[1] + 1 if self.stay[0] == b else 1)
        self._wake(batch)
        synced = [r for r in batch if r.draft.speculate]
        caps = [r.round_k(r.k) for r in synced]
        rows0 = sum(len(r.draft.pending) for r in synced)
        ks, startup = self.choose(batch, synced, caps) if synced else ([], False)
        ks = [c if r.seeded_sampling else k for r, k, c in zip(synced, ks, caps)]      # (module docstring, Choice)
        spec = synced if any(ks) or startup else []
        if spec:
            self.drafted[bucket(len(batch))] = self.round
        for r, k, c in zip(synced, ks, caps):
            st = self.state(r)
            r.round_cap, st.idle = k, 0 if k else st.idle + 1
            st.shallow = st.shallow + 1 if 0 < k < c else 0
            if not spec:                     # no Propose this round: the draft falls behind on them
                r.draft.park()
                st.parked_at = self.round
                self.parks += 1
                self.next_wake = self.next_wake or self.round + int(min(MAX_REPROBE, self._interval(r, len(batch))))
        self._last = (len(batch), rows0, max(ks, default=0), sum(ks)) if spec else (len(batch), 0, 0, 0)
        return spec

    def choose(self, batch: list[GenRequest], synced: list[GenRequest], caps: list[int]) -> tuple[list[int], bool]:
        """-> k of each synced request (the start-up schedule, a refresh, else the best point of the gain
        path) and whether this is a start-up round (sent to the draft even at k = 0)."""
        b, top = bucket(len(batch)), max(caps)
        n, full = self.started.get(b, 0), START_CYCLES * (top + 1)
        settled = self.stay[1] >= SETTLE or n or not any(v >= full for v in self.started.values())
        if n < full and top and settled:
            self.started[b] = n + 1
            return [min(c, top - n % (top + 1)) for c in caps], True
        unsettled = n < full and top      # priced off the lines, but nobody parked: its start-up may follow
        if self.round - self.drafted.setdefault(b, self.round) >= REFRESH and top:
            return caps, False
        age = self.costs.plain_age(len(batch))
        if top and (self.plain_run or min(age or 0, self.stay[1]) >= PLAIN_EVERY         # (not in passing)
                    or self.stay[1] > PLAIN_RUN and self.costs.plain_s(len(batch)) is None):
            self.plain_run = (self.plain_run or PLAIN_RUN) - 1
            return [0] * len(caps), True
        forced, deeper = [], any(0 < (r.round_cap or 0) < c and self.state(r).shallow >= SYNC_PROBE
                                 for r, c in zip(synced, caps))
        for r, c in zip(synced, caps):
            st, last = self.state(r), r.round_cap or 0
            if c > 0 and (st.probing or st.idle >= SYNC_PROBE):
                forced.append(1)
            else:       # one draft deeper now and then, so the next position's figure stays live: all shallow
                forced.append(min(c, last + 1) if 0 < last < c and deeper else 0)     # requests in one round
        priors = {g: [self.class_rate(g, i) for i in range(top)] for g in (True, False)}
        gains = [self.gains(r, c, priors) for r, c in zip(synced, caps)]
        ks = best_path(gains, forced, len(batch), 0, self.costs)
        if log.isEnabledFor(logging.DEBUG):
            price, n = self.costs.pricer(len(batch)), len(batch) + sum(sum(g[:k]) for g, k in zip(gains, ks))
            log.debug("round %d batch %d: k %s, %.2f tokens in %.2f ms (k = 0: %.2f ms); p %s", self.round, len(batch),
                      ks, n, 1e3 * price(sum(ks), max(ks)), 1e3 * price(0, 0), [[round(x, 2) for x in g] for g in gains])
        return ks, unsettled

    def joining(self, reqs: list[GenRequest]) -> None:
        for r in reqs:                      # their catch-up only (module docstring, Choice; seeded: their cap)
            r.round_cap = r.round_cap if r.seeded_sampling else 0

    def observe(self, batch: list[GenRequest], split: dict[str, float]) -> None:
        drafted, outcome = 0, []
        for r in batch:
            st = r.policy_state
            if st is None:
                continue
            d = r.stats.num_draft_tokens - st.seen[0]
            a = r.stats.num_accepted_tokens - st.seen[1]
            st.seen = (r.stats.num_draft_tokens, r.stats.num_accepted_tokens)
            outcome.append((d, a))
            if d > 0:
                st.acc.add(d, a)
                self.classes[st.greedy].add(d, a)
                st.probing = False
                drafted += d
        if self._last is None:
            return
        batch_size, rows0, steps, planned = self._last
        log.debug("round %d: (drafted, accepted) %s; split s %s", self.round, outcome, split)
        self._last = None
        self.costs.observe_round(batch_size, batch_size + drafted, split,
                                 (rows0, steps, planned) if planned and drafted == planned else None)

    def resynced(self, tokens: int, seconds: float) -> None:
        self.costs.observe_resync(tokens, seconds)

    # --- parked requests ------------------------------------------------------------------------------
    def _wake(self, batch: list[GenRequest]) -> None:
        """Every reprobe interval, wake the longest-parked request: re-synced next step, then probed."""
        if not self.next_wake or self.round < self.next_wake:
            return
        parked = [r for r in batch if r.draft.parked]
        if not parked:
            self.next_wake = 0
            return
        parked = [r for r in parked if self._interval(r, len(batch)) <= MAX_REPROBE]   # the budget pays for these
        if not parked:
            self.next_wake = self.round + MAX_REPROBE
            return
        r = min(parked, key=lambda r: self.state(r).parked_at)
        r.draft.wake()
        self.state(r).probing = True
        self.wakes += 1
        self.next_wake = self.round + int(self._interval(r, len(batch)))

    def _interval(self, r: GenRequest, batch: int) -> float:
        """Rounds until the next wake: the flag's, or what PROBE_BUDGET of the round time pays for (over
        MAX_REPROBE: not paid for)."""
        if self.reprobe_rounds:
            return self.reprobe_rounds
        probe = self.costs.probe_s(len(r.prompt_ids) + len(r.output_ids))
        round_s = self.costs.round_s(batch, 0, 0, 0)
        return MIN_REPROBE if round_s <= 0 else max(MIN_REPROBE, probe / (PROBE_BUDGET * round_s))
