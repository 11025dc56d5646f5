"""Overlapped rounds (gateway/proposals.py) over the fake services of test_scheduler_faults.py: the next
round's Propose goes out before this round commits, and nothing about the output, the draft's state or the
fault rules changes for it.

The fakes record each call with what the gateway had committed when it was made, so "before the commit" is
checked, not assumed.
"""
from __future__ import annotations

import asyncio

import grpc

from tandem.v1 import draft_pb2

from gateway.adaptive import AdaptivePolicy, FixedPolicy
from gateway.request import Observer
from gateway.scheduler import Scheduler
from gateway.text import TextStream
from test_scheduler_faults import NEXT, FakeDraft, FakeTarget, Letters, events, request, rpc_error, run


class Draft(FakeDraft):
    """Records, per Propose, the committed output of each request at the call; fails from call `fail_from` on
    with `code` (1-based), and answers after `delay` seconds."""

    def __init__(self, reqs=(), fail_from: int = 0, code=grpc.StatusCode.UNAVAILABLE, delay: float = 0.0):
        super().__init__()
        self.reqs, self.fail_from, self.code, self.delay = list(reqs), fail_from, code, delay
        self.seen: list[dict[str, int]] = []          # per Propose: request id -> len(output_ids) at the call
        self.order: list[str] = []                    # "Propose:<ids>" / "Propose done" / "Release:<ids>"

    async def Propose(self, req, timeout=None):
        self.seen.append({r.id: len(r.output_ids) for r in self.reqs})
        self.order.append("Propose:" + ",".join(it.request_id for it in req.items))
        n = len(self.seen)
        await asyncio.sleep(self.delay)
        try:
            if self.fail_from and n >= self.fail_from:
                self.calls.append(("Propose", req, timeout))
                raise rpc_error(self.code, "fake failure")
            return await super().Propose(req, timeout)
        finally:
            self.order.append("Propose done")

    async def Release(self, req, timeout=None):
        self.order.append("Release:" + ",".join(req.request_ids))
        return await super().Release(req, timeout)


async def drive(s: Scheduler, reqs, steps: int = 100):
    for r in reqs:
        s.submit(r)
    for _ in range(steps):
        if not s.running and not s.waiting and not s.prefilling:
            break
        await s.step()
    await asyncio.sleep(0.2)                          # the Release tasks run


def test_overlapped_rounds_propose_before_the_commit_and_change_no_output():
    async def main(overlap: bool, mixed: bool = False):
        target, draft = FakeTarget(), Draft()
        s = Scheduler(target, draft, {2}, overlap=overlap, mixed_prefill=mixed)
        reqs = [request(s, (3, 4, 5 + i), max_tokens=13 + i, k=2 + i % 2) for i in range(3)]
        late = request(s, (9, 9), max_tokens=11, k=3)
        draft.reqs = reqs + [late]
        for r in reqs:
            s.submit(r)
        await s.step()
        assert (s.ahead is not None) == overlap
        s.submit(late)                      # arrives while (overlapped) round 2's Propose is out: prefilled
        await s.step()                      # meanwhile, then its first Propose (the prompt) in round 2
        if mixed:                           # its Prefill rode round 2's Verify: its first Propose is round 3's
            verify = [req for name, req, _ in target.calls if name == "Verify"][-1]
            assert [it.request_id for it in verify.prefill.items] == [late.id] and "Prefill" not in target.names()[1:]
            assert late.stats.num_drafts == 0 and late.output_ids == [NEXT] and s.mixed_prefills == 1
            await s.step()
        assert late.stats.num_drafts == 1 and late.output_ids[:1] == [NEXT]
        await drive(s, [])
        return reqs + [late], draft
    serial, d0 = run(main(False))
    overlapped, d1 = run(main(True))
    mixed, _ = run(main(True, mixed=True))
    for a, b in zip(overlapped, mixed):
        assert a.output_ids == b.output_ids and b.finished
    for a, b in zip(serial, overlapped):
        assert a.output_ids == b.output_ids == [NEXT] * a.max_tokens and b.finished
        assert a.stats.num_drafts == b.stats.num_drafts and a.stats.num_accepted_tokens == b.stats.num_accepted_tokens
    # serial: every Propose after the first sees the last round committed; overlapped: most see it not yet
    # committed (the same count as at the Propose before: the Verify in between answered, its tokens wait)
    behind = sum(1 for x, y in zip(d1.seen, d1.seen[1:]) for rid in y if rid in x and y[rid] == x[rid] > 0)
    assert behind >= 3, d1.seen
    assert not any(y[rid] == x[rid] > 0 for x, y in zip(d0.seen, d0.seen[1:]) for rid in y if rid in x), d0.seen


class Splits(Observer):
    def __init__(self):
        self.rounds: list[dict] = []

    def round_split(self, seconds):
        self.rounds.append(dict(seconds))


def test_a_request_finished_by_the_commit_is_released_after_the_propose_that_names_it():
    """A stop string ends r at the commit of round 2, after round 3's Propose named it (the gateway cannot know
    before it detokenizes): its Release waits for that Propose. A request that max_tokens ends is known to end
    at the commit, and no Propose names it after its last Verify."""
    async def main():
        target, draft, obs = FakeTarget(), Draft(delay=0.05), Splits()
        s = Scheduler(target, draft, {2}, observer=obs)
        r = request(s, max_tokens=40, k=3)         # 1 + 4 + 4 tokens: the commit of round 2 completes the stop
        r.text = TextStream(Letters(), [Letters().decode([NEXT] * 9)])
        draft.reqs = [r]
        await drive(s, [r])
        await asyncio.sleep(0.5)                    # idle, then a new request: the unused Propose is dropped,
        nxt = request(s, max_tokens=9, k=3)         # and no round is timed from before the idle time
        draft.reqs.append(nxt)
        await drive(s, [nxt])
        return r, nxt, draft, obs
    r, nxt, draft, obs = run(main())
    assert r.finished and r.output_ids == [NEXT] * 9 and nxt.output_ids == [NEXT] * 9
    assert len(obs.rounds) == 4 and all(x["round"] < 0.4 for x in obs.rounds), obs.rounds
    # round 2's Verify answered, then round 3's Propose went out (naming r), then the commit finished r
    proposes = [i for i, o in enumerate(draft.order) if o == f"Propose:{r.id}"]
    release = draft.order.index(f"Release:{r.id}")
    assert len(proposes) == 3 and proposes[-1] < release
    assert draft.order[release - 1] == "Propose done", draft.order
    # nxt: the prompt's Propose and round 2's, sent ahead in round 1; none after round 2's Verify
    assert draft.order.count(f"Propose:{nxt.id}") == 2, draft.order


class EosTarget(FakeTarget):
    """Its second Verify ends with EOS (2) for every request."""
    async def Verify(self, req, timeout=None):
        resp = await super().Verify(req, timeout)
        if sum(c[0] == "Verify" for c in self.calls) == 2:
            for res in resp.results:
                res.emitted_token_ids[-1] = 2
        return resp


def test_no_propose_names_a_request_an_eos_ends():
    """An EOS among a Verify's tokens ends the request at the commit: the next round's Propose, sent before the
    commit, leaves it out (ignore_eos: it goes on, and is proposed for)."""
    async def main(ignore_eos: bool):
        target, draft = EosTarget(), Draft()
        s = Scheduler(target, draft, {2})
        r = request(s, max_tokens=40, k=3)
        r.ignore_eos = ignore_eos
        draft.reqs = [r]
        await drive(s, [r])
        return r, draft
    r, draft = run(main(False))
    assert r.finished and r.output_ids == [NEXT] * 8 and draft.order.count(f"Propose:{r.id}") == 2, draft.order
    r, draft = run(main(True))
    assert r.finished and len(r.output_ids) == 40 and draft.order.count(f"Propose:{r.id}") > 3, draft.order


def test_a_failed_overlapped_propose_degrades_then_resyncs_and_resumes(monkeypatch):
    async def main():
        target, draft = FakeTarget(), Draft(fail_from=2)      # round 2's Propose, sent ahead in round 1
        s = Scheduler(target, draft, {2}, draft_timeout_s=3.0)
        r = request(s, max_tokens=40)
        draft.reqs = [r]
        s.submit(r)
        await s.step()                                  # Prefill, round 1 (4 tokens), round 2's Propose sent
        assert r.output_ids == [NEXT] * 5 and s.ahead is not None
        await s.step()                                  # collects the failure: round 2 without drafts
        assert len(r.output_ids) == 6 and s.avail.degraded and r.draft.stale and s.ahead is None
        draft.fail_from = 0
        monkeypatch.setattr(s.avail, "retry_at", 0.0)
        s.avail.draft_answers()
        target.calls.clear()
        n = len(draft.order)
        await s.step()                                  # re-sync (Release, RecomputeRows), Propose, Verify
        assert draft.order[n:n + 2] == ["Release:" + r.id, "Propose:" + r.id], draft.order[n:]
        assert target.names()[:2] == ["RecomputeRows", "Verify"]
        item = draft.calls[-1][1].items[0] if draft.calls[-1][0] == "Propose" else None
        assert item is not None and r.stats.num_drafts == 2
        await drive(s, [])
        assert r.output_ids == [NEXT] * 40 and not events(r)[-1].error
    run(main())


def test_a_contract_error_in_an_overlapped_propose_fails_the_round():
    async def main():
        target, draft = FakeTarget(), Draft(fail_from=2, code=grpc.StatusCode.FAILED_PRECONDITION)
        s = Scheduler(target, draft, {2})
        r = request(s)
        draft.reqs = [r]
        s.submit(r)
        await s.step()
        await s.step()
        assert r.finished and events(r)[-1].error[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert s.avail.degraded is None and not s.running
    run(main())


def test_a_request_cancelled_between_overlapped_rounds_is_freed_after_its_propose():
    async def main():
        target, draft = FakeTarget(), Draft(delay=0.05)
        s = Scheduler(target, draft, {2})
        a, b = request(s, max_tokens=40), request(s, (6, 7), max_tokens=40)
        draft.reqs = [a, b]
        s.submit(a), s.submit(b)
        await s.step()                                  # round 1; round 2's Propose (a, b) in flight
        s.cancel(a)                                     # client gone now
        assert a.finished and a not in s.running
        assert f"Release:{a.id}" not in draft.order     # not while the Propose naming it runs
        await s.step()
        await asyncio.sleep(0.05)
        release = draft.order.index(f"Release:{a.id}")
        assert draft.order.index("Propose done") < release
        verify = [c[1] for c in target.calls if c[0] == "Verify"][-1]
        assert [it.request_id for it in verify.items] == [b.id] and len(b.output_ids) > 5
    run(main())


def test_a_round_planned_before_the_commit_counts_the_uncommitted_tokens():
    async def main():
        target, draft = FakeTarget(), Draft()
        s = Scheduler(target, draft, {2})
        r = request(s, (3, 4, 5), max_tokens=100, k=3)
        r.max_model_len = 9                             # after round 1 (8 tokens held) room for 1 draft
        draft.reqs = [r]
        s.submit(r)
        await s.step()
        await asyncio.sleep(0)
        ks = [it.num_draft_tokens for c in draft.calls if c[0] == "Propose" for it in c[1].items]
        assert ks[:2] == [3, 1], ks
    run(main())


class WrongDraft(FakeDraft):
    """Proposes a token the fake target never emits: every draft is rejected."""

    async def Propose(self, req, timeout=None):
        await self._call("Propose", req, timeout)
        return draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(
            draft_token_ids=[NEXT + 1] * it.num_draft_tokens) for it in req.items])


class CountingPolicy(AdaptivePolicy):
    """Adaptive, counting its plans, and choosing k = 0 for everyone (as it would with drafts that always fail
    on a machine where they cost: the fakes' costs are too small and too noisy to decide it)."""
    plans = 0

    def plan(self, batch):
        self.plans += 1
        return super().plan(batch)

    def choose(self, batch, synced, caps):
        return [0] * len(synced), False


def test_a_round_is_planned_once_when_nobody_drafts():
    """Drafts that always fail: the adaptive policy parks the requests, and the round the last round planned
    (overlapped: at its end) is not planned again; a request is planned twice for a round only when it became
    synced since (prefilled, or re-synced for a probe). The chosen-k histogram counts each request once a round."""
    async def main():
        target, draft = FakeTarget(), WrongDraft()
        policy = CountingPolicy(3, reprobe_rounds=16)
        s = Scheduler(target, draft, {2}, policy=policy)
        reqs = [request(s, (3, 4, 5 + i), max_tokens=120, k=3) for i in range(2)]
        await drive(s, reqs, steps=400)
        return policy, [c[1] for c in target.calls if c[0] == "Verify"], reqs
    policy, verifies, reqs = run(main())
    assert all(r.finished and r.output_ids == [NEXT] * 120 for r in reqs)
    assert policy.parks > 0 and policy.wakes > 2, (policy.parks, policy.wakes)
    assert len(verifies) <= policy.plans <= len(verifies) + policy.wakes + len(reqs), (policy.plans, len(verifies))
    assert sum(policy.k_counts) == sum(len(v.items) for v in verifies), policy.k_counts
    assert policy.k_counts[0] == sum(policy.k_counts), policy.k_counts


class ParkFirst(FixedPolicy):
    """Fixed K, but the first request is parked at plan 3 and woken at plan 7 (as the adaptive policy parks and
    re-probes), while the other keeps drafting."""
    def __init__(self):
        super().__init__(3)
        self.n = 0

    def plan(self, batch):
        self.n += 1
        first = min(batch, key=lambda r: r.id)
        if self.n == 3:
            first.draft.park()
        elif self.n == 7:
            first.draft.wake()
        return super().plan(batch)


def test_a_woken_request_reads_its_own_row_set():
    """A request parked while another drafts is still in every Verify, whose row set names it; once woken and
    re-synced, its Propose carries both that Verify's set (for the other request) and its re-sync's set. Each
    item names the set it reads (ProposeItem.rows_set), as the fake draft's contract check demands."""
    async def main(overlap: bool):
        target, draft = FakeTarget(), Draft()
        s = Scheduler(target, draft, {2}, policy=ParkFirst(), overlap=overlap)
        reqs = [request(s, (3, 4, 5 + i), max_tokens=40, k=2) for i in range(2)]
        await drive(s, reqs)
        both = [c[1] for c in draft.calls if c[0] == "Propose" and len(c[1].hidden_rows) == 2]
        return reqs, target.names(), both
    for overlap in (False, True):
        reqs, calls, both = run(main(overlap))
        for r in reqs:
            assert r.finished and r.output_ids == [NEXT] * 40 and not any(e.error for e in events(r)), overlap
        assert "RecomputeRows" in calls and both, (overlap, calls)
        woken = min(reqs, key=lambda r: r.id)
        resync = [(p, it) for p in both for it in p.items if it.request_id == woken.id and it.position == 0
                  and len(it.new_token_ids) > 4]          # its re-sync's Propose: every committed token
        assert len(resync) == 1, (overlap, both)
        p, it = resync[0]
        other = 3 - it.rows_set                             # the other set (the last Verify's) names it too
        assert it.rows_set in (1, 2) and woken.id in p.hidden_rows[other - 1].request_ids, p
        assert list(p.hidden_rows[it.rows_set - 1].rows_per_request) == [len(it.new_token_ids) - 1], p


class DraftAll(AdaptivePolicy):
    """Adaptive, but every synced request drafts its cap each round (the fakes' costs cannot decide it)."""
    def choose(self, batch, synced, caps):
        return list(caps), False


def test_a_request_joining_a_round_planned_ahead_drafts_what_the_policy_gives_it():
    """A request prefilled while the next round's Propose is already out rides on it for its catch-up. Under
    the fixed policy it drafts its K there; under the adaptive one 0, since no plan chose its k (on the H200 a
    wave of 31 new requests drafting 3 each, with sampled drafts' distributions, took a 226 ms round against
    17 ms where the policy drafted for none), and the next plan gives it a k."""
    async def main(policy):
        target, draft = FakeTarget(), Draft()
        s = Scheduler(target, draft, {2}, policy=policy, overlap=True)
        first = request(s, (3, 4, 5), max_tokens=30, k=3)
        s.submit(first)
        for _ in range(4):
            await s.step()
        late = request(s, (3, 4, 6), max_tokens=12, k=3)
        await drive(s, [late])
        items = [it for c in draft.calls if c[0] == "Propose" for it in c[1].items if it.request_id == late.id]
        return first, late, [it.num_draft_tokens for it in items], [it.position for it in items]
    for policy, k_first in ((FixedPolicy(3), 3), (DraftAll(3), 0)):
        first, late, ks, positions = run(main(policy))
        assert first.finished and late.finished and late.output_ids == [NEXT] * 12, policy.name
        assert positions[0] == 0 and ks[0] == k_first, (policy.name, ks, positions)
        assert max(ks[1:]) == 3, (policy.name, ks)
