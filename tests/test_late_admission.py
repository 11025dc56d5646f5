"""--late-admission (gateway/chunking.py admit_late) over the fake services of test_scheduler_faults.py, with
test_overlap_rounds.py's recording draft: a request that arrives while a round waits for its drafts rides that
round's Verify, and the round holds it like its own (cancel, a failed Verify)."""
from __future__ import annotations

import asyncio

import grpc

from gateway.scheduler import Scheduler
from test_overlap_rounds import Draft, drive
from test_scheduler_faults import NEXT, FakeTarget, request, run


async def late_round(target, late_on: bool, arriving, reqs_spec=((20, 2), (20, 2))):
    """Requests of reqs_spec (max_tokens, k) run a round with a draft that answers in 50 ms; then round 2 runs
    while `arriving(s, late)` (a coroutine) submits `late` into it -> (scheduler, requests, late), round 2 done."""
    s = Scheduler(target, Draft(delay=0.05), {2}, mixed_prefill=True, late_admission=late_on)
    reqs = [request(s, (3, 4, 5 + i), max_tokens=m, k=k) for i, (m, k) in enumerate(reqs_spec)]
    late = request(s, (9, 9), max_tokens=11, k=3)
    s.draft.reqs = reqs + [late]
    for r in reqs:
        s.submit(r)
    await s.step()                                          # their Prefill, round 1; round 2's Propose goes out
    task = asyncio.ensure_future(arriving(s, late))
    await s.step()                                          # round 2: waits ~50 ms for its drafts
    await task
    return s, reqs, late


async def submit_at_20ms(s, late):
    await asyncio.sleep(0.02)
    s.submit(late)


def test_a_request_arriving_while_the_round_waits_for_drafts_rides_its_verify_with_late_admission():
    """--late-admission: a request that arrives while round 2 waits for its Propose rides round 2's Verify (its
    prompt in that forward) and runs from round 3, a round sooner than without, with the same tokens."""
    async def main(late_on: bool):
        target = FakeTarget()
        s, reqs, late = await late_round(target, late_on, submit_at_20ms, [(13 + i, 2 + i % 2) for i in range(3)])
        verify = [req for name, req, _ in target.calls if name == "Verify"][-1]
        rode = [it.request_id for it in verify.prefill.items]
        if late_on:
            assert rode == [late.id] and late in s.running and late.output_ids == [NEXT] and s.late_admissions == 1
        else:
            assert rode == [] and late in s.waiting and s.late_admissions == 0
        await drive(s, [])
        return reqs + [late], s
    on, s_on = run(main(True))
    off, _ = run(main(False))
    for a, b in zip(on, off):
        assert a.finished and b.finished and a.output_ids == b.output_ids == [NEXT] * a.max_tokens
    assert not s_on._held


def test_a_late_admitted_request_cancelled_during_the_verify_is_finished_and_released():
    """Admitted late, a request is held by the round in flight like those it started with: its client gone while
    the Verify runs, it is finished when the round returns and released on both services, not left running."""
    class SlowVerify(FakeTarget):
        async def Verify(self, req, timeout=None):
            await asyncio.sleep(0.05)
            return await super().Verify(req, timeout)

    async def arrive_then_leave(s, late):
        await submit_at_20ms(s, late)                       # admitted into round 2's Verify at ~50 ms
        await asyncio.sleep(0.06)
        assert s.late_admissions == 1 and late in s._held
        s.cancel(late)                                      # during that Verify

    async def main():
        target = SlowVerify()
        s, reqs, late = await late_round(target, True, arrive_then_leave)
        assert late.finished and late not in s.running and late not in s.prefilling
        await drive(s, [])
        released = [rid for name, req, _ in target.calls if name == "Release" for rid in req.request_ids]
        assert late.id in released and all(r.finished and r.output_ids == [NEXT] * 20 for r in reqs)
    run(main())


def test_a_late_admitted_request_whose_verify_fails_waits_again_and_completes():
    """The Verify a late admission rode fails (INTERNAL: the round's requests end with it): the new request, of
    which the target kept nothing, goes back to the head of the queue and is served by the next steps."""
    target = FakeTarget()

    async def arrive(s, late):
        await submit_at_20ms(s, late)
        target.fail = grpc.StatusCode.INTERNAL              # round 2's Verify, which it rides

    async def main():
        s, reqs, late = await late_round(target, True, arrive)
        verify = [req for name, req, _ in target.calls if name == "Verify"][-1]
        assert [it.request_id for it in verify.prefill.items] == [late.id] and s.late_admissions == 1
        assert all(r.finished and r.output_ids != [NEXT] * 20 for r in reqs)     # failed with their round
        assert s.waiting == [late] and not late.finished
        target.fail = None
        await drive(s, [])
        assert late.finished and late.output_ids == [NEXT] * 11
    run(main())
