"""The gateway's fault rules in process, over fake services (no processes, a few seconds): a failed
Propose finishes the round without drafts and degrades speculation; the draft answering again
resumes it after re-syncing the running requests (Release, RecomputeRows, Propose at position 0
with every committed token); a target that is UNAVAILABLE fails the round and refuses new requests
until it answers; deadlines fail and free requests and bound the calls; the queue limit refuses
with RESOURCE_EXHAUSTED (HTTP 429); GetInfo changes are named; `tandem serve`'s restart policy.

The fake target's next token is always 7 (greedy): a draft of 7s is accepted, anything else is
not, and every round commits accepted + 1 sevens, so the committed tokens are known exactly.
"""
from __future__ import annotations

import asyncio
import sys
import time

import grpc
import pytest

from gateway import availability, ending
from gateway.availability import Availability
from gateway.core import GenerationError, QueueFull
from gateway.request import Observer
from gateway.scheduler import GenRequest, Scheduler
from gateway.text import TextStream
from gateway.watch import info_changes
from tandem.v1 import common_pb2, draft_pb2, rows_pb2, target_pb2

NEXT = 7


def rpc_error(code: grpc.StatusCode, details: str = "fake") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def rows(ids, counts) -> rows_pb2.HiddenRows:
    return rows_pb2.HiddenRows(request_ids=ids, rows_per_request=counts, num_rows=sum(counts))


class FakeTarget:
    def __init__(self):
        self.calls: list[tuple[str, object, float]] = []
        self.fail: grpc.StatusCode | None = None
        self.fail_details = ""

    async def _call(self, name, req, timeout):
        self.calls.append((name, req, timeout))
        if self.fail is not None and name != "Release":
            raise rpc_error(self.fail, self.fail_details or f"{name} refused")

    async def Prefill(self, req, timeout=None):
        await self._call("Prefill", req, timeout)
        return self.prefilled(req)

    @staticmethod
    def prefilled(req: target_pb2.PrefillRequest) -> target_pb2.PrefillResponse:
        ids = [it.request_id for it in req.items]
        return target_pb2.PrefillResponse(first_token_ids=[NEXT] * len(ids), hidden_rows=rows(
            ids, [len(it.prompt_token_ids) for it in req.items]) if req.return_hidden_rows else None)

    async def Verify(self, req, timeout=None):
        """As the target's: a Prefill riding the Verify (VerifyRequest.prefill) is answered in VerifyResponse.prefill."""
        await self._call("Verify", req, timeout)
        acc = [next((i for i, t in enumerate(it.draft_token_ids) if t != NEXT), len(it.draft_token_ids))
               for it in req.items]
        return target_pb2.VerifyResponse(
            results=[target_pb2.VerifyResult(num_accepted=a, emitted_token_ids=[NEXT] * (a + 1)) for a in acc],
            hidden_rows=rows([it.request_id for it in req.items], [a + 1 for a in acc]) if req.return_hidden_rows else None,
            prefill=self.prefilled(req.prefill) if req.HasField("prefill") else None)

    async def RecomputeRows(self, req, timeout=None):
        await self._call("RecomputeRows", req, timeout)
        return target_pb2.RecomputeRowsResponse(hidden_rows=rows(
            [it.request_id for it in req.items], [len(it.token_ids) - 1 for it in req.items]))

    async def Release(self, req, timeout=None):
        await self._call("Release", req, timeout)
        return common_pb2.ReleaseResponse()

    def names(self) -> list[str]:
        return [c[0] for c in self.calls if c[0] != "Release"]


class FakeDraft(FakeTarget):
    async def Propose(self, req, timeout=None):
        await self._call("Propose", req, timeout)
        row_sets_named(req)
        return draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(
            draft_token_ids=[NEXT] * it.num_draft_tokens) for it in req.items])


def row_sets_named(req: draft_pb2.ProposeRequest) -> None:
    """The draft's contract on a Propose's row sets (services/draft/server.py): each item reads the set its
    rows_set names, which must name the request; rows_set 0: exactly one set may name it."""
    for it in req.items:
        naming = [i for i, h in enumerate(req.hidden_rows, 1) if it.request_id in h.request_ids]
        if it.rows_set > len(req.hidden_rows) or (it.rows_set and it.rows_set not in naming) or \
                (not it.rows_set and len(naming) != 1):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request {it.request_id!r}: rows_set "
                            f"{it.rows_set}, named by sets {naming}")


class Letters:
    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def request(s: Scheduler, prompt=(3, 4, 5), max_tokens=40, k=3) -> GenRequest:
    return GenRequest(id=s.new_id(), prompt_ids=list(prompt), max_tokens=max_tokens,
                      sampling=rows_pb2.SamplingParams(), text=TextStream(Letters(), []), ignore_eos=True, k=k)


def events(r: GenRequest) -> list:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


def run(coro):
    return asyncio.run(coro)


def test_slow_or_rowless_propose_keeps_the_bridge():
    # only a gone draft (UNAVAILABLE) loses the bridge; a Propose past its deadline (a first compile,
    # a stall) or one whose rows were overwritten (NOT_FOUND) degrades the round and keeps it
    async def main():
        for code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
            target, draft = FakeTarget(), FakeDraft()
            s = Scheduler(target, draft, {2}, draft_timeout_s=3.0, transport=rows_pb2.TRANSPORT_BRIDGE, overlap=False)
            r = request(s)
            s.submit(r)
            await s.step()
            draft.fail = code
            await s.step()
            assert s.avail.degraded and r.draft.stale, code
            assert s.transport == rows_pb2.TRANSPORT_BRIDGE, code
    run(main())


def test_a_failed_propose_counts_as_propose_time_not_gateway_time():
    # the round split: a Propose that ran 0.3 s and failed is propose time; gateway = round less both RPCs
    class SlowFailingDraft(FakeDraft):
        async def Propose(self, req, timeout=None):
            await asyncio.sleep(0.3)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")

    class Splits(Observer):
        def __init__(self):
            self.rounds: list[dict] = []

        def round_split(self, seconds):
            self.rounds.append(dict(seconds))

    async def main():
        obs = Splits()
        s = Scheduler(FakeTarget(), SlowFailingDraft(), {2}, draft_timeout_s=3.0, observer=obs)
        s.submit(request(s))
        await s.step()
        await s.step()
        return obs.rounds
    rounds = run(main())
    failed = next(r for r in rounds if r["propose"] > 0)
    assert failed["propose"] >= 0.3 and failed["gateway"] < 0.2, failed
    assert failed["transfer"] == failed["draft_compute"] == 0.0


def test_draft_failure_degrades_then_resyncs_and_resumes(monkeypatch):
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        s = Scheduler(target, draft, {2}, draft_timeout_s=3.0, overlap=False)   # overlapped: test_overlap_rounds.py
        r = request(s)
        s.submit(r)
        await s.step()                                  # Prefill, then a round of 3 accepted drafts
        assert r.output_ids == [NEXT] * 5 and r.stats.num_drafts == 1
        draft.fail = grpc.StatusCode.UNAVAILABLE
        await s.step()                                  # Propose fails: the round commits 1 token, no drafts
        verify = target.calls[-1][1]
        assert list(verify.items[0].draft_token_ids) == [] and len(r.output_ids) == 6
        assert s.avail.degraded and "UNAVAILABLE" in s.avail.degraded and r.draft.stale and not r.draft.speculate
        assert s.transport == rows_pb2.TRANSPORT_INLINE and s.avail.speculation()["state"] == "degraded"
        draft.fail = None
        n = len(draft.calls)
        await s.step()                                  # still degraded: no Propose, one more plain token
        assert len(draft.calls) == n and len(r.output_ids) == 7
        s.avail.draft_answers()                         # the backoff holds it back ...
        assert s.avail.degraded
        monkeypatch.setattr(s.avail, "retry_at", 0.0)
        s.avail.draft_answers()                         # ... then it resumes
        assert s.avail.degraded is None
        target.calls.clear()
        await s.step()
        committed = [3, 4, 5] + [NEXT] * 7
        assert [c[0] for c in draft.calls[n:]] == ["Release", "Propose"]
        assert list(draft.calls[n][1].request_ids) == [r.id]
        assert target.names() == ["RecomputeRows", "Verify"]
        assert list(target.calls[0][1].items[0].token_ids) == committed
        assert target.calls[0][1].transport == rows_pb2.TRANSPORT_INLINE
        item = draft.calls[-1][1].items[0]
        assert item.position == 0 and list(item.new_token_ids) == committed
        assert s.avail.resynced == 1 and not r.draft.stale and r.draft.speculate and r.stats.num_drafts == 2
        assert r.output_ids == [NEXT] * 11            # nothing lost, nothing doubled
        await s.step()                                  # and the draft continues from there
        assert draft.calls[-1][1].items[0].position == len(committed)
    run(main())


def test_broken_row_contract_is_the_clusters_fault_not_the_clients():
    """A row-count mismatch between the services (the draft answers INVALID_ARGUMENT "hidden rows contract: ...")
    fails the round with INTERNAL and the services' message: the client sent nothing wrong."""
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        s = Scheduler(target, draft, {2}, overlap=False)
        r = request(s)
        s.submit(r)
        await s.step()

        async def propose(req, timeout=None):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "hidden rows contract: the MTP block returned 10 rows "
                                                              "for 19 input tokens (expected 19)")
        draft.Propose = propose
        await s.step()
        code, message = events(r)[-1].error
        assert code == grpc.StatusCode.INTERNAL and "returned 10 rows for 19 input tokens" in message and r.finished
    run(main())


def test_contract_error_from_the_draft_fails_the_round():
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        s = Scheduler(target, draft, {2}, overlap=False)
        r = request(s)
        s.submit(r)
        await s.step()
        draft.fail = grpc.StatusCode.FAILED_PRECONDITION
        await s.step()
        assert events(r)[-1].error[0] == grpc.StatusCode.FAILED_PRECONDITION and r.finished
        assert s.avail.degraded is None
    run(main())


@pytest.mark.parametrize("failure, details", [(grpc.StatusCode.UNAVAILABLE, ""),
                                              (grpc.StatusCode.INTERNAL, "Internal error from Core")])
def test_target_unavailable_fails_the_round_and_refuses_until_back(failure, details):
    """A target that is gone: UNAVAILABLE, or gRPC core's own INTERNAL when it died in the middle of its answer
    (seen in the chaos test: the round must fail as the target's absence, not as an internal error)."""
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        s = Scheduler(target, draft, {2}, max_waiting=8)
        rs = [request(s, (3 + i, 4)) for i in range(3)]
        for r in rs:
            s.submit(r)
        await s.step()
        target.fail, target.fail_details = failure, details
        await s.step()
        for r in rs:
            assert r.finished and events(r)[-1].error[0] == grpc.StatusCode.UNAVAILABLE
        assert not s.running and s.avail.target_down
        code, msg = s.avail.admit(1, 0)
        assert code == grpc.StatusCode.UNAVAILABLE and "unavailable" in msg
        s.avail.target_answers()
        assert s.avail.admit(1, 0) is None and s.avail.rejected["target_unavailable"] == 1
    run(main())


def test_deadlines_bound_the_calls_and_expire_requests():
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        s = Scheduler(target, draft, {2}, rpc_timeout_s=60.0, draft_timeout_s=10.0)
        a, b = request(s, max_tokens=1000), request(s, (6,), max_tokens=1000)
        a.deadline = b.deadline = time.monotonic() + 2.0
        s.submit(a)
        s.submit(b)
        await s.step()
        for name, _, timeout in target.calls + draft.calls:
            if name != "Release":
                assert 1.0 < timeout <= 2.0, (name, timeout)
        b.deadline = None                               # one request without a deadline: the caps
        target.calls.clear(), draft.calls.clear()
        await s.step()
        assert [c[2] for c in target.calls] == [60.0] and [c[2] for c in draft.calls] == [10.0]
        a.deadline = time.monotonic() - 0.01
        target.calls.clear()
        await s.step()                                  # a expires before the round; b goes on
        assert a.finished and events(a)[-1].error[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert a not in s.running and b in s.running
        await asyncio.sleep(0)                          # the Release tasks run
        released = [list(c[1].request_ids) for c in target.calls if c[0] == "Release"]
        verify = [c[1] for c in target.calls if c[0] == "Verify"][-1]
        assert [a.id] in released and [it.request_id for it in verify.items] == [b.id]
    run(main())


def test_a_release_that_fails_is_sent_again(monkeypatch):
    """A Release lost to a target that did not answer (UNAVAILABLE, DEADLINE_EXCEEDED) left the request and its KV
    blocks held there for good (found probing as a user): the gateway sends it again; another status ends it."""
    monkeypatch.setattr(ending, "RELEASE_RETRY_S", (0.01, 0.01, 0.01))

    class Flaky(FakeTarget):
        def __init__(self, codes):
            super().__init__()
            self.codes = list(codes)

        async def Release(self, req, timeout=None):
            await self._call("Release", req, timeout)
            if self.codes:
                raise rpc_error(self.codes.pop(0))
            return common_pb2.ReleaseResponse(released=1)

    async def main():
        for codes, sent in [([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED], 3),
                            ([grpc.StatusCode.UNAVAILABLE] * 9, 4), ([grpc.StatusCode.INVALID_ARGUMENT], 1)]:
            target = Flaky(codes)
            await Scheduler(target, FakeDraft(), {2})._release(target, ["gone"])
            assert [c[0] for c in target.calls] == ["Release"] * sent, (codes, target.calls)
    run(main())


def test_queue_limit_refuses_with_resource_exhausted():
    av = Availability(has_draft=True, max_waiting=2)
    assert av.admit(2, 0) is None
    code, msg = av.admit(1, 2)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting" in msg
    assert av.rejected["queue_full"] == 1
    assert QueueFull(code, msg).http_status == 429 and GenerationError(code, msg).http_status is None
    assert Availability(has_draft=False).admit(10_000, 10_000) is None      # 0: unbounded


def test_degradation_backoff_grows_and_resets(monkeypatch):
    av = Availability(has_draft=True)
    av.draft_failed("one")
    first = av.retry_at - av.degraded_since
    av.draft_failed("still down")                      # while degraded the resume time does not move
    assert av.retry_at - av.degraded_since == first and av.degraded == "still down"
    monkeypatch.setattr(av, "retry_at", 0.0)
    av.draft_answers()
    av.draft_failed("again")
    assert av.retry_at - av.degraded_since == pytest.approx(2 * first)
    av.draft_proposed()
    assert av.backoff_s == availability.BACKOFF_START_S and av.draft_failures == 2


def test_info_changes_name_the_model_not_the_load():
    a = common_pb2.InfoResponse(model="m", vocab_size=512, kv_blocks_total=10, kv_blocks_free=3, running_requests=2)
    b = common_pb2.InfoResponse(model="m", vocab_size=512, kv_blocks_total=20, kv_blocks_free=20)
    assert info_changes(a, b) == []
    c = common_pb2.InfoResponse(model="other", vocab_size=1024)
    assert info_changes(a, c) == ["model: was 'm', now 'other'", "vocab_size: was 512, now 1024"]


def test_supervisor_restarts_with_backoff_then_gives_up(monkeypatch, capsys):
    from tandem import supervise
    monkeypatch.setattr(supervise, "BASE_S", 0.05)
    sup = supervise.Supervisor([("svc", [sys.executable, "-c", "raise SystemExit(3)"])], {}, max_restarts=2)
    sup.start("svc")
    results = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not results or results[-1]):
        sup.procs["svc"].wait(timeout=20)
        results.append(sup.check(lambda: False))
    assert results == [True, True, False]
    err = capsys.readouterr().err
    assert err.count("exited with code 3; restarting it") == 2 and "--max-restarts 2): stopping" in err


def test_a_service_refuses_a_call_whose_deadline_passed():
    """infra.grpc_server.time_left: a call that waited past its caller's deadline (for the engine
    lock) is refused before it does anything; one with time left (or no deadline) runs."""
    from infra.grpc_server import time_left

    class Context:
        def __init__(self, left):
            self.left, self.aborted = left, None

        def time_remaining(self):
            return self.left

        def abort(self, code, details):
            self.aborted = (code, details)
            raise RuntimeError("aborted")

    late = Context(-0.01)
    with pytest.raises(RuntimeError):
        time_left(late)
    assert late.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED and "nothing was done" in late.aborted[1]
    assert time_left(Context(3.0)) == 3.0 and time_left(Context(None)) is None
