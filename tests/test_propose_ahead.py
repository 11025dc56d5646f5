"""A round ahead (issue 14): the gateway's Verify names the next round's draft work, the target sends that
Propose to the draft's local lane as soon as it has the tokens and rows, the gateway collects the drafts.

Served (target, draft, three gateways as processes on one host): the same greedy and seeded sampled outputs
with and without it, greedy equal to plain decoding, and the metric that counts the rounds it served. The
contract: a Verify whose `ahead` cannot be sent is INVALID_ARGUMENT naming the field, before any work. The
draft's store (services/draft/ahead.py): a collect that comes first waits for the push, an id never pushed is
NOT_FOUND, a push that failed answers its own status."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from cluster import Cluster, make_checkpoint, serve_module
from gateway.scheduler import Scheduler
from gateway.text import TextStream
from infra.errors import ServiceError
from services.draft import ahead as draft_ahead
from tandem.v1 import draft_pb2, generate_pb2 as gen, rows_pb2, target_pb2
from test_overlap_rounds import drive
from test_scheduler_faults import NEXT, FakeDraft, FakeTarget, Letters, events, request, rpc_error, run

K = 3
LANE = "tandem-propose-1-00"
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def push(self, x):", "# naïve → ok ✓\n",
           "x = 1\n" * 40]


GATEWAYS = [{"name": "ahead"}, {"name": "sent", "args": ["--no-propose-ahead"]}, {"name": "plain", "k": 0},
            {"name": "nojoin", "args": ["--no-join-ahead"]}, {"name": "inline", "hidden_transport": "inline"},
            {"name": "acceptfirst", "args": ["--no-early-propose"]}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=7)
    with Cluster(ckpt, k=K, gateways=GATEWAYS, hidden_transport="auto", log_dir=tmp_path_factory.mktemp("logs"),
                 targets=[{"args": ["--early-propose", "on"]}]) as c:      # (auto: on CUDA only)
        yield from serve_module(c, request)


@pytest.fixture(scope="module")
def gloo_cluster(tmp_path_factory, request):
    """The same over gloo: rows pushed as frames through a process group (services/bridge/push.py), not a ring."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=7)
    with Cluster(ckpt, k=K, gateways=GATEWAYS, hidden_transport="gloo", log_dir=tmp_path_factory.mktemp("logs"),
                 targets=[{"args": ["--early-propose", "on"]}]) as c:
        yield from serve_module(c, request)


def generate(gw, i: int, prompt: str, sampled: bool, max_tokens: int = 24) -> tuple[list[int], int, int]:
    r = gw.stub.Generate(gen.GenerateRequest(text=prompt, max_tokens=max_tokens, ignore_eos=True, seed=100 + i,
                                             temperature=1.0 if sampled else 0.0), timeout=120)
    return list(r.token_ids), r.spec_stats.num_draft_tokens, r.spec_stats.num_accepted_tokens


def outputs(gw, sampled: bool) -> list[tuple[list[int], int, int]]:
    """Every prompt at once (one batch), greedy or seeded sampled: (tokens, drafts, accepted) each."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda ip: generate(gw, *ip, sampled), enumerate(PROMPTS)))


def ahead_rounds(gw, name: str = "spec_decode_proposals_ahead") -> float:
    text = httpx.get(gw.http_url + "/metrics", timeout=30).text
    m = re.search(rf"^tandem:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"no tandem:{name}_total in /metrics"
    return float(m.group(1))


@pytest.mark.slow
def test_proposes_sent_ahead_change_no_output(cluster):
    ahead, sent, plain = (next(g for g in cluster.gateways if g.name == n) for n in ("ahead", "sent", "plain"))
    before = ahead_rounds(ahead)
    greedy = outputs(ahead, sampled=False)
    assert ahead_rounds(ahead) > before, "no round had its Propose sent ahead by the target"
    # the same drafts: the same tokens and the same acceptance, request by request
    assert greedy == outputs(sent, sampled=False)
    assert [t for t, _, _ in greedy] == [t for t, _, _ in outputs(plain, sampled=False)]
    assert all(len(t) == 24 for t, _, _ in greedy) and sum(a for _, _, a in greedy) > 0
    assert outputs(ahead, sampled=True) == outputs(sent, sampled=True)
    assert ahead_rounds(sent) == 0


@pytest.mark.slow
@pytest.mark.parametrize("ahead, field", [
    (dict(ahead_id="a", draft_lane=LANE, items=[target_pb2.AheadItem(request_id="nope", num_draft_tokens=1)]),
     "not an item of this Verify"),
    (dict(ahead_id="a", draft_lane=LANE, items=[target_pb2.AheadItem(request_id="r", num_draft_tokens=0)]),
     "num_draft_tokens 0"),
    (dict(ahead_id="", draft_lane=LANE, items=[target_pb2.AheadItem(request_id="r", num_draft_tokens=1)]),
     "needs ahead_id"),
    (dict(ahead_id="a", draft_lane="some-other-socket", items=[target_pb2.AheadItem(request_id="r", num_draft_tokens=1)]),
     "ahead.draft_lane: a draft's local lane"),
    (dict(ahead_id="a", draft_lane=LANE, items=[target_pb2.AheadItem(request_id="r", num_draft_tokens=1)], early=True,
          expect_join=True), "early and expect_join are both set"),
])
def test_an_ahead_that_cannot_be_sent_is_invalid_argument(cluster, ahead, field):
    req = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id="r")], return_hidden_rows=True,
                                   ahead=target_pb2.ProposeAhead(**ahead))
    with pytest.raises(grpc.RpcError) as e:
        cluster.target.Verify(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ahead" in e.value.details()
    assert field in e.value.details(), e.value.details()


def test_an_early_propose_without_its_rows_on_the_bridge_is_invalid_argument(cluster):
    inline = rows_pb2.HiddenRows(request_ids=["r"], rows_per_request=[2], num_rows=2, transport=rows_pb2.TRANSPORT_INLINE)
    for sets in ([], [inline]):
        with pytest.raises(grpc.RpcError) as e:
            cluster.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id="r", num_draft_tokens=1, position=3)], hidden_rows=sets, acceptance_transfer_id=7), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert f"acceptance_transfer_id: an early Propose has one rows set, on the bridge, every verified row; got " \
               f"{len(sets)} sets" in e.value.details()


def staggered(gw, max_tokens: int = 96) -> list[tuple[list[int], int, int]]:
    """The prompts greedy: the first alone, then two at a time 20 ms apart, so they arrive while others run (each
    lasts ~30 rounds) and join them, several in one round."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = []
        for i, p in enumerate(PROMPTS):
            futures.append(pool.submit(generate, gw, i, p, False, max_tokens))
            if i % 2 == 0:
                time.sleep(0.02)
        return [f.result() for f in futures]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_requests_that_join_ride_the_push_and_change_no_output(request, transport):
    """Requests whose prompts ride a Verify that pushes the next round's Propose join with their first Propose
    computed in the push's pass (one chain of draft steps, not two in a row); their tokens stay plain decoding's."""
    cluster = request.getfixturevalue("cluster" if transport == "auto" else "gloo_cluster")
    ahead, sent, plain = (next(g for g in cluster.gateways if g.name == n) for n in ("ahead", "sent", "plain"))
    before = ahead_rounds(ahead, "spec_decode_joins_with_ahead")
    got = staggered(ahead)
    assert ahead_rounds(ahead, "spec_decode_joins_with_ahead") > before, "no join rode a push"
    assert [t for t, _, _ in got] == [t for t, _, _ in staggered(plain)]
    assert all(len(t) == 96 for t, _, _ in got) and sum(a for _, _, a in got) > 0
    assert staggered(sent) == got           # the same drafts too: the same acceptance, request by request
    nojoin = next(g for g in cluster.gateways if g.name == "nojoin")
    assert staggered(nojoin) == got and ahead_rounds(nojoin) > 0      # pushed, their joins apart
    assert ahead_rounds(sent, "spec_decode_joins_with_ahead") == ahead_rounds(nojoin, "spec_decode_joins_with_ahead") == 0


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_the_rows_a_verify_pushes_are_the_rows_sent_inline(request, transport):
    """On a ring (shared memory here) a Verify pushes every verified token's rows before its acceptance is known and
    the draft reads the committed ones (HiddenRows.used_rows_per_request); over gloo the committed rows go after the
    acceptance. Either way the same drafts as rows sent inline, so the same acceptance, request by request, greedy
    and seeded sampled."""
    cluster = request.getfixturevalue("cluster" if transport == "auto" else "gloo_cluster")
    ahead, inline = (next(g for g in cluster.gateways if g.name == n) for n in ("ahead", "inline"))
    for sampled in (False, True):
        got = outputs(ahead, sampled)
        assert got == outputs(inline, sampled) and sum(a for _, _, a in got) > 0
        assert sum(d - a for _, d, a in got) > 0, "no draft was rejected: the rows after the committed went unused"


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_a_push_sent_before_the_acceptance_changes_no_output(request, transport):
    """On a ring the target pushes the next round's Propose as its Verify's acceptance is queued, the acceptance on
    the ring beside every verified row, and the draft steps over all of them before reading it
    (services/draft/early.py): the same drafts as a push sent after the acceptance (--no-early-propose), so the same
    tokens and acceptance request by request, greedy and seeded sampled. Over gloo (no ring) none goes early."""
    cluster = request.getfixturevalue("cluster" if transport == "auto" else "gloo_cluster")
    now, after = (next(g for g in cluster.gateways if g.name == n) for n in ("ahead", "acceptfirst"))
    before = ahead_rounds(now, "spec_decode_proposals_early")
    for sampled in (False, True):
        got = outputs(now, sampled)
        assert got == outputs(after, sampled) and sum(a for _, _, a in got) > 0
        assert sum(d - a for _, d, a in got) > 0, "no draft was rejected: no row past the accepted was rolled back"
    early = ahead_rounds(now, "spec_decode_proposals_early") - before
    assert early > 0 if transport == "auto" else early == 0, early
    assert ahead_rounds(after, "spec_decode_proposals_early") == 0 < ahead_rounds(after)


@pytest.mark.slow
def test_on_a_ring_a_verify_pushes_every_verified_row_and_declares_the_committed(cluster):
    """Raw calls over the shared-memory ring: a Verify's rows are every verified token's (k + 1, on the ring before
    its acceptance was known) and used_rows_per_request names the committed ones (a + 1), which the draft takes."""
    bridge, r, prompt = rows_pb2.TRANSPORT_BRIDGE, "ring-used-1", [5 + i % 50 for i in range(9)]
    try:
        pre = cluster.target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id=r, prompt_token_ids=prompt)], return_hidden_rows=True, transport=bridge), timeout=30)
        new, rows, position = prompt + list(pre.first_token_ids), pre.hidden_rows, 0
        for _ in range(3):
            item = draft_pb2.ProposeItem(request_id=r, new_token_ids=new, num_draft_tokens=K, position=position)
            drafts = cluster.draft.Propose(draft_pb2.ProposeRequest(items=[item], hidden_rows=[rows]),
                                           timeout=30).results[0].draft_token_ids
            position += len(new)
            v = cluster.target.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
                request_id=r, draft_token_ids=drafts)], return_hidden_rows=True, transport=bridge), timeout=30)
            a, new, rows = v.results[0].num_accepted, list(v.results[0].emitted_token_ids), v.hidden_rows
            assert (list(rows.rows_per_request), list(rows.used_rows_per_request)) == ([K + 1], [a + 1])
    finally:
        cluster.release([r])


@pytest.mark.slow
def test_a_join_and_its_push_fail_together_with_the_pass(cluster):
    """The draft computes a push and the join riding it in one pass: an empty pair answers both, the join marked
    computed with the push; a join the contract refuses fails the pass, so the push's collect answers that status."""
    def pair(aid: str, join_items: list) -> tuple:
        push = cluster.draft.Propose.future(draft_pb2.ProposeRequest(ahead_id=aid, expect_join=True), timeout=30)
        joined = cluster.draft.Propose.future(draft_pb2.ProposeRequest(ride_ahead_id=aid, items=join_items),
                                              timeout=30)
        assert push.result() == draft_pb2.ProposeResponse()          # a push is answered empty at once
        return joined, cluster.draft.Propose.future(draft_pb2.ProposeRequest(collect_ahead_id=aid), timeout=30)
    joined, collected = pair("join-test-ok", [])
    assert joined.result().computed_with_ahead_id == "join-test-ok" and not collected.result().results
    ghost = draft_pb2.ProposeItem(request_id="ghost", new_token_ids=[5, 6], num_draft_tokens=1, position=0)
    joined, collected = pair("join-test-bad", [ghost])
    for f in (joined, collected):
        with pytest.raises(grpc.RpcError) as e:
            f.result()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'ghost'" in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:         # a push or a collect cannot ride a push
        cluster.draft.Propose(draft_pb2.ProposeRequest(ride_ahead_id="x", collect_ahead_id="y"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ride_ahead_id" in e.value.details()


def test_a_push_and_its_join_meet_whichever_comes_first(monkeypatch):
    monkeypatch.setattr(draft_ahead, "JOIN_WAIT_S", 2.0)
    monkeypatch.setattr(draft_ahead, "PUSH_WAIT_S", 2.0)
    for push_first in (True, False):
        joins, got = draft_ahead.Joins(), {}
        meet = threading.Thread(target=lambda: got.update(met=joins.meet("a")))
        ride = threading.Thread(target=lambda: got.update(rode=joins.ride("a", "the join's request")))
        first, second = (meet, ride) if push_first else (ride, meet)
        first.start()
        time.sleep(0.1)
        second.start()
        first.join(5), second.join(5)
        assert got["met"] is got["rode"] and got["met"].request == "the join's request" and got["met"].taken


def test_a_push_whose_join_never_comes_holds_the_targets_lane_briefly():
    """A push waits for its join on the draft's reader of the target's lane, which carries every gateway's pushes:
    a join that never comes (its gateway died between the Verify and the join) holds the others' pushes 0.1 s, not
    the 1 s a join waits for its push on its own gateway's lane."""
    joins = draft_ahead.Joins()
    t0 = time.monotonic()
    assert joins.meet("orphan") is None and 0.09 <= time.monotonic() - t0 < 0.5


def test_a_push_or_join_alone_waits_once_then_goes_alone(monkeypatch):
    monkeypatch.setattr(draft_ahead, "JOIN_WAIT_S", 0.1)
    monkeypatch.setattr(draft_ahead, "PUSH_WAIT_S", 0.1)
    joins = draft_ahead.Joins()
    t0 = time.monotonic()
    assert joins.meet("p") is None and time.monotonic() - t0 >= 0.09     # its join never came
    t0 = time.monotonic()
    assert joins.ride("p", "late join") is None and time.monotonic() - t0 < 0.05   # closed: no second wait
    assert joins.ride("j", "join") is None                                # its push never came
    t0 = time.monotonic()
    assert joins.meet("j") is None and time.monotonic() - t0 < 0.05
    waiting = threading.Thread(target=joins.ride, args=("twice", "first"))
    waiting.start()
    time.sleep(0.02)
    with pytest.raises(ServiceError) as e:
        joins.ride("twice", "second")
    waiting.join()
    assert e.value.code == "INVALID_ARGUMENT" and "ride_ahead_id" in str(e.value)


def test_a_collect_waits_for_its_push():
    store = draft_ahead.AheadStore()
    store.pushed("a1")
    answer = draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(draft_token_ids=[5, 6])])
    threading.Timer(0.2, store.done, ("a1", answer)).start()
    t0 = time.monotonic()
    assert store.collect("a1", 10.0) is answer and time.monotonic() - t0 >= 0.15
    assert len(store) == 0


def test_a_collect_of_an_id_never_pushed_is_not_found(monkeypatch):
    monkeypatch.setattr(draft_ahead, "GRACE_S", 0.1)
    with pytest.raises(ServiceError) as e:
        draft_ahead.AheadStore().collect("never", 10.0)
    assert e.value.code == "NOT_FOUND" and "never" in str(e.value)


def test_a_push_that_failed_answers_its_status_and_an_unfinished_one_times_out():
    store = draft_ahead.AheadStore()
    store.pushed("bad")
    store.done("bad", ServiceError("FAILED_PRECONDITION", "request 'r': position is 3, the draft holds 0"))
    got = store.collect("bad", 1.0)
    assert isinstance(got, ServiceError) and got.code == "FAILED_PRECONDITION"
    store.pushed("slow")
    with pytest.raises(ServiceError) as e:
        store.collect("slow", 0.2)
    assert e.value.code == "DEADLINE_EXCEEDED"


def test_outcomes_nobody_collects_are_bounded(monkeypatch):
    monkeypatch.setattr(draft_ahead, "MAX_KEPT", 4)
    store = draft_ahead.AheadStore()
    for i in range(10):
        store.pushed(f"a{i}")
        store.done(f"a{i}", draft_pb2.ProposeResponse())
    assert len(store) <= 4


# --- the gateway's side over fake services (tests/test_scheduler_faults.py): no processes -------------------
class LaneMethod:
    """A stub method with the name of the local lane it is called on (gateway/local_lane.py LocalLane.lane)."""

    def __init__(self, fn, lane: str):
        self.fn, self.lane = fn, lane

    async def __call__(self, req, timeout=None):
        return await self.fn(req, timeout)


class AheadDraft(FakeDraft):
    """Keeps a pushed Propose's answer for its collect; checks every Propose's position against the tokens it
    holds (FAILED_PRECONDITION, as the draft); records pushes, Proposes, collects and Releases in order."""

    def __init__(self):
        super().__init__()
        self.kept, self.held, self.order = {}, {}, []
        self.Propose = LaneMethod(self._propose, LANE)

    async def _propose(self, req, timeout=None):
        if req.collect_ahead_id:
            self.order.append("collect")
            resp = await self.kept.pop(req.collect_ahead_id)
            self.order.append("collected")
            return resp
        self.order.append(("push:" if req.ahead_id else "Propose:") + ",".join(it.request_id for it in req.items))
        for it in req.items:
            if it.position != self.held.get(it.request_id, 0):
                raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"request {it.request_id!r}: position is "
                                f"{it.position}, the draft holds {self.held.get(it.request_id, 0)} tokens of it")
            self.held[it.request_id] = it.position + len(it.new_token_ids)
        await asyncio.sleep(0.01)
        return await FakeDraft.Propose(self, req, timeout)

    async def Release(self, req, timeout=None):
        self.order.append("Release:" + ",".join(req.request_ids))
        for rid in req.request_ids:
            self.held.pop(rid, None)
        return await super().Release(req, timeout)


class AheadTarget(FakeTarget):
    """Sends the draft the Propose a Verify names (as services/target/ahead.py), or (sends False) reports it
    could not; counts the Verifies that named one."""

    def __init__(self, draft: AheadDraft, sends: bool = True):
        super().__init__()
        self.draft, self.sends, self.named = draft, sends, 0
        self.Verify = LaneMethod(self._verify, "tandem-verify-1-00")

    async def _verify(self, req, timeout=None):
        resp = await FakeTarget.Verify(self, req, timeout)
        if req.HasField("ahead"):
            self.named += 1
        if req.HasField("ahead") and self.sends:
            emitted = {it.request_id: list(res.emitted_token_ids) for it, res in zip(req.items, resp.results)}
            push = draft_pb2.ProposeRequest(ahead_id=req.ahead.ahead_id, hidden_rows=[resp.hidden_rows], items=[
                draft_pb2.ProposeItem(request_id=a.request_id, new_token_ids=emitted[a.request_id], rows_set=1,
                                      num_draft_tokens=a.num_draft_tokens, position=a.position)
                for a in req.ahead.items])
            self.draft.kept[req.ahead.ahead_id] = asyncio.ensure_future(self.draft._propose(push))
            resp.ahead_sent = True
        return resp


def test_the_target_sends_the_next_rounds_propose_and_nothing_changes():
    async def main(ahead: bool, sends: bool = True):
        draft = AheadDraft()
        target = AheadTarget(draft, sends)
        s = Scheduler(target, draft, {2}, propose_ahead=ahead)
        reqs = [request(s, (3, 4, 5 + i), max_tokens=13 + i, k=2 + i % 2) for i in range(3)]
        await drive(s, reqs)
        return reqs, s, target, draft
    plain, s0, t0, d0 = run(main(False))
    for sends in (True, False):
        reqs, s, target, draft = run(main(True, sends))
        for a, b in zip(plain, reqs):
            assert a.output_ids == b.output_ids == [NEXT] * a.max_tokens and b.finished and not events(b)[-1].error
            assert (a.stats.num_drafts, a.stats.num_accepted_tokens) == (b.stats.num_drafts, b.stats.num_accepted_tokens)
        assert target.named >= 3 and (s.ahead_rounds == target.named) == sends, (target.named, s.ahead_rounds)
        pushes, collects = sum(o.startswith("push:") for o in draft.order), draft.order.count("collected")
        assert (pushes, collects) == ((s.ahead_rounds, s.ahead_rounds) if sends else (0, 0)), draft.order
    assert t0.named == 0 and s0.ahead_rounds == 0 and "collect" not in d0.order


def test_a_request_finished_by_the_commit_is_released_after_the_collect():
    """A stop string ends r at the commit of a round whose Verify had already named it for the next round (the
    gateway cannot know before it detokenizes): its draft Release waits until that push's collect answers."""
    async def main():
        draft = AheadDraft()
        s = Scheduler(AheadTarget(draft), draft, {2})
        r = request(s, max_tokens=40, k=3)
        r.text = TextStream(Letters(), [Letters().decode([NEXT] * 9)])
        await drive(s, [r])
        return r, s, draft
    r, s, draft = run(main())
    assert r.finished and r.output_ids == [NEXT] * 9 and s.ahead_rounds >= 1
    release = draft.order.index(f"Release:{r.id}")
    assert draft.order[release - 3:release] == [f"push:{r.id}", "collect", "collected"], draft.order
