"""The draft's step over every verified row before the acceptance is read (services/draft/early.py), engine level.

Two target/draft pairs from the same weights run the same rounds: one proposes from the committed rows as the
target answered them (DraftEngine.propose), the other from every verified row and the acceptance frame the
target queued (DraftEngine.propose_early, fed by TargetEngine's push_rows / push_acceptance hooks). Each round's
drafts must be the same, greedy (accepted at random: synthetic acceptance) and sampled, with rejections among them
(rows past the accepted computed and rolled back), the chain run before the acceptance is read or after it. A frame that is not a Verify's acceptance is INTERNAL and leaves the request where it was."""
from __future__ import annotations

import pytest
import torch

from infra.errors import ServiceError
from services.draft import early
from services.draft import chain as chain_module
from services.draft.chain import DraftChain
from services.draft.engine import ProposeItem
from services.sampling import Sampling
from services.config import ServiceConfig
from services.ranks import RankGroup
from services.target.server import TargetServicer
from tandem.inprocess import TensorChannel, _Context
from tandem.v1 import rows_pb2, target_pb2
from tests.test_engines import engines, make_models

PROMPTS = {"a": [5, 9, 13, 2, 7, 7, 30], "b": [11, 3], "c": list(range(40, 77))}


def hooked(te):
    """te's pushes captured: (all verified rows [N, D], acceptance [B, K+2]) of its last Verify."""
    got = {}
    te.push_rows = lambda tid, hidden: got.setdefault("rows", hidden.clone())
    te.push_acceptance = lambda both, rows: got.setdefault("frame", both.clone())
    return got


def pairs(sampling, device="cpu", chain=False):
    """Two engine pairs of the same weights after the prompts' prefill and first Propose; greedy rounds accept drafts
    at random (synthetic acceptance 0.8, the same draws on both targets: random weights accept almost none), so the
    rows past the accepted ones are those of any position."""
    target, draft = make_models(head_std=0.5, seed=3)
    target, draft = target.to(device), draft.to(device)
    (te1, de1), (te2, de2) = engines(target, draft), engines(target, draft)
    for te in (te1, te2) if all(x.greedy for x in sampling.values()) else ():
        te.synthetic_acceptance = (0.8,)
    for de in (de1, de2) if chain and device == "cpu" else ():   # the chain eagerly: queued before the acceptance
        de.chain = DraftChain(draft, de.cache, de.max_model_len, 4, graphs=False)
    if device == "cuda":                              # as served: CUDA graphs, the chain, the frame read aside
        from models import cuda_graphs
        for te, de in ((te1, de1), (te2, de2)):
            cuda_graphs.enable(te)
            cuda_graphs.enable(de, extra_rows=1)
            de.graphs_enabled()
    firsts = []
    for te, de in ((te1, de1), (te2, de2)):
        first, hidden, *_ = te.prefill([(r, p, sampling[r]) for r, p in PROMPTS.items()])
        rows = dict(zip(PROMPTS, hidden.split([len(p) for p in PROMPTS.values()])))
        items = [ProposeItem(r, p + [t], 3, sampling[r], 0) for (r, p), t in zip(PROMPTS.items(), first)]
        firsts.append(de.propose(items, rows))
    assert [d for d, _ in firsts[0]] == [d for d, _ in firsts[1]]
    return (te1, de1), (te2, de2), firsts[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("chain", [False, True])
def test_early_propose_drafts_what_propose_drafts(temperature, device, chain, monkeypatch):
    """Rounds 1, 3, 5, 7 laid out before the frame, as the draft's server does (DraftEngine.lay_out_early, used by
    the pass: not laid out again); round 3 after a layout whose frame never came (another request set's: unused).
    On CUDA, rounds where every request drafts (1, 5, 6, 7) run step 0 and the chain as one graph (chain.py); round 8,
    of a new shape once the early graphs kept are at their cap, runs step 0 apart."""
    if device == "cuda" and chain:
        pytest.skip("the GPU runs its captured chain either way")
    layouts = []
    monkeypatch.setattr(early, "lay_out", lambda *a, f=early.lay_out: layouts.append(a[1:]) or f(*a))
    sampling = {r: Sampling(temperature=temperature, seed=1 + i) for i, r in enumerate(PROMPTS)}
    (te1, de1), (te2, de2), proposals = pairs(sampling, device, chain)
    got = hooked(te2)
    ids, rejected, accepted, graphed = list(PROMPTS), 0, 0, 0
    position = {r: len(p) + 1 for r, p in PROMPTS.items()}
    for rnd in range(9):
        k = {r: (rnd + i) % 4 if rnd < 6 else 3 if rnd < 8 else 2 for i, r in enumerate(ids)}   # 0..3 drafts
        if rnd == 8:
            monkeypatch.setattr(chain_module, "MAX_EARLY_GRAPHS", 1)
        items = [(r, d, q) for r, (d, q) in zip(ids, proposals)]
        v1 = te1.verify(items)
        got.clear()
        v2 = te2.verify(items, push=1)
        assert v1.accepted == v2.accepted and v1.emitted == v2.emitted
        rejected += sum(len(d) - a for (_, d, _), a in zip(items, v1.accepted))
        accepted += sum(a for a, (_, d, _) in zip(v1.accepted, items) if len(d) > 1)
        late = [ProposeItem(r, t, k[r], sampling[r], position[r]) for r, t in zip(ids, v1.emitted)]
        p1 = de1.propose(late, dict(zip(ids, v1.rows.split([a + 1 for a in v1.accepted]))))
        now = [ProposeItem(r, [], k[r], sampling[r], position[r]) for r in ids]
        verified = [len(d) + 1 for _, d, _ in items]
        early.check_items(de2, now, verified, 3)
        layouts.clear()
        if rnd == 3:                                                     # a pass whose frame never came
            de2.lay_out_early(now[:1], verified[:1], [0])
        if rnd % 2:
            de2.lay_out_early(now, verified, list(range(len(ids))))
            assert all(de2.cache.length(r) >= de2.committed[r] + n for r, n in zip(ids, verified))
        p2 = de2.propose_early(now, got["rows"], verified, got["frame"], list(range(len(ids))))
        assert len(layouts) == 1 + (rnd == 3) and layouts[-1][0] is now and de2.early is None
        assert [it.new_token_ids for it in now] == v1.emitted            # the new tokens, read from the frame
        assert [d for d, _ in p1] == [d for d, _ in p2], f"round {rnd}"
        for (_, q1), (_, q2) in zip(p1, p2):
            assert (q1 is None) == (q2 is None)
            if q1 is not None:
                torch.testing.assert_close(q1.dense(te1.vocab_size, "cpu"), q2.dense(te1.vocab_size, "cpu"))
        if device == "cuda" or chain:
            assert de2.chain.runs > 0
        if device == "cuda":                                           # step 0 in the chain's graph: all drafting
            assert de2.chain.early_runs - graphed == (rnd in (1, 5, 6, 7)), f"round {rnd}"
            graphed = de2.chain.early_runs
        assert de1.committed == de2.committed and de1.tokens == de2.tokens
        assert {r: de1.cache.length(r) for r in ids} == {r: de2.cache.length(r) for r in ids}
        for r, t in zip(ids, v1.emitted):
            position[r] += len(t)
        proposals = p1
    assert rejected > 0, "no draft was rejected: rows past the accepted were never rolled back"
    assert temperature or accepted > 3, "greedy rounds accepted too few drafts to place a chain after them"


@pytest.mark.parametrize("chain", [False, True])
def test_a_frame_that_is_not_an_acceptance_is_internal_and_moves_nothing(chain):
    sampling = {r: Sampling() for r in PROMPTS}
    _, (te, de), proposals = pairs(sampling, chain=chain)
    got = hooked(te)
    ids = list(PROMPTS)
    items = [(r, d, q) for r, (d, q) in zip(ids, proposals)]
    te.verify(items, push=1)
    verified = [len(d) + 1 for _, d, _ in items]
    before = ({r: de.cache.length(r) for r in ids}, dict(de.committed), {r: list(t) for r, t in de.tokens.items()})
    bad = got["frame"].clone()
    bad[1, 0] = verified[1]                                             # more accepted than it had drafts
    now = [ProposeItem(r, [], 2, sampling[r], de.committed[r] + 1) for r in ids]
    with pytest.raises(ServiceError) as e:
        de.propose_early(now, got["rows"], verified, bad, [0, 1, 2])
    assert e.value.code == "INTERNAL" and "acceptance frame" in str(e.value) and "'b'" in str(e.value)
    for shape in (got["frame"].reshape(-1), got["frame"][:, :2]):        # not [requests, 2 + K] of this Verify
        with pytest.raises(ServiceError) as e:
            de.propose_early(now, got["rows"], verified, shape, [0, 1, 2])
        assert e.value.code == "INTERNAL" and "the acceptance frame is" in str(e.value)
    after = ({r: de.cache.length(r) for r in ids}, dict(de.committed), {r: list(t) for r, t in de.tokens.items()})
    assert after[1:] == before[1:]
    assert all(after[0][r] == de.committed[r] for r in ids)            # the speculative positions dropped only
    out = de.propose_early(now, got["rows"], verified, got["frame"], [0, 1, 2])   # the real one still goes
    assert [len(d) for d, _ in out] == [2, 2, 2]


def test_early_items_are_checked_before_anything_moves():
    sampling = {r: Sampling() for r in PROMPTS}
    _, (te, de), _ = pairs(sampling)
    ok = [ProposeItem(r, [], 2, sampling[r], de.committed[r] + 1) for r in PROMPTS]
    for bad, verified, code, words in (
            ([ProposeItem("zz", [], 2, Sampling(), 1)] + ok[1:], [2, 2, 2], "FAILED_PRECONDITION", "does not hold"),
            ([ProposeItem("a", [], 2, Sampling(), de.committed["a"] + 3)] + ok[1:], [2, 2, 2], "FAILED_PRECONDITION",
             f"names position {de.committed['a'] + 1}"),
            ([ProposeItem("a", [4], 2, Sampling(), de.committed["a"] + 1)] + ok[1:], [2, 2, 2], "INVALID_ARGUMENT",
             "1 new_token_ids"),
            (ok, [2, 0, 2], "INVALID_ARGUMENT", "has 0 rows, expected 1 to 4")):
        with pytest.raises(ServiceError) as e:
            early.check_items(de, bad, verified, 3)
        assert e.value.code == code and words in str(e.value), str(e.value)


class RingChannel(TensorChannel):
    """The in-process bridge as a ring (a Verify's rows pushed as its forward is queued), its sends logged; a send to
    a transfer id in `fail` raises, as a broken ring's would."""
    ring = pushes = True

    def __init__(self, device, log: list, fail=()):
        super().__init__(device)
        self.log, self.fail = log, set(fail)

    def send(self, transfer_id: int, rows) -> None:
        self.log.append(("rows" if rows.dtype != torch.int64 else "acceptance", transfer_id))
        if transfer_id in self.fail:
            raise RuntimeError("the ring is gone")
        super().send(transfer_id, rows)


class Lane:
    """AheadSender's place: the pushes the target writes to the draft's lane, logged."""

    def __init__(self, log: list):
        self.log, self.sent = log, []

    def send(self, ahead, emitted, rows, acceptance_tid: int = 0) -> bool:
        self.log.append(("propose", acceptance_tid))
        self.sent.append((ahead.ahead_id, emitted, rows.transfer_id, acceptance_tid))
        return True


@pytest.mark.parametrize("acceptance_lost", [False, True])
def test_the_early_propose_leaves_with_the_rows_before_the_acceptance(acceptance_lost, caplog):
    """A Verify whose `ahead` is early: its rows go on the ring, then the next round's Propose naming the transfer
    the acceptance will come in, then the acceptance (so the draft lays its pass out while the target queues its
    logits). An acceptance that cannot be pushed after that Propose left costs the draft that round (its take
    answers NOT_FOUND), not the Verify: it answers in full."""
    target, draft = make_models(seed=3)
    te, _ = engines(target, draft)
    log = []
    ring = RingChannel("cpu", log, fail=[2] if acceptance_lost else [])
    cfg = ServiceConfig(role="target", model="in-process", device="cpu", max_draft_tokens=4, early_propose="on")
    servicer = TargetServicer(cfg, RankGroup(te, te.model.ps), ring)
    servicer.ahead = lane = Lane(log)
    prompt = PROMPTS["a"]
    te.prefill([("a", prompt, Sampling())])
    request = target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(request_id="a", draft_token_ids=[4, 5, 6])], return_hidden_rows=True,
        transport=rows_pb2.TRANSPORT_BRIDGE, ahead=target_pb2.ProposeAhead(
            ahead_id="g-1-ahead", draft_lane="tandem-propose-1-00", early=True,
            items=[target_pb2.AheadItem(request_id="a", num_draft_tokens=3, position=len(prompt) + 1)]))
    with caplog.at_level("WARNING", logger="tandem.target"):
        resp = servicer.Verify(request, _Context())
    assert log == [("rows", 1), ("propose", 2), ("acceptance", 2)]      # transfer ids count from 1 per servicer
    rows_tid, acc_tid = log[0][1], log[1][1]
    assert lane.sent == [("g-1-ahead", None, rows_tid, acc_tid)] and acc_tid != rows_tid
    assert resp.ahead_sent and resp.ahead_early
    a = resp.results[0].num_accepted
    assert len(resp.results[0].emitted_token_ids) == a + 1 and resp.hidden_rows.transfer_id == rows_tid
    if acceptance_lost:
        assert acc_tid not in ring.rows and "the draft's early pass answers NOT_FOUND" in caplog.text
    else:
        assert ring.rows[acc_tid][0, 0].item() == a and ring.rows[acc_tid][0, 1:a + 2].tolist() == \
            list(resp.results[0].emitted_token_ids)
