"""Hostile input to the internal services: hypothesis-generated TargetService (Prefill, Verify, Release,
GetInfo) and DraftService (Propose, Release, GetInfo) messages against a running cluster — random
field values, oversized repeated fields, NaN / inf in the sampling floats, in draft_probs / draft_top_probs and in
inline hidden rows, wrong dtypes, sizes, layouts and transports in HiddenRows.

Every call must succeed with token ids in [0, vocab) and finite draft probabilities, or fail with a
client-error status (fuzz_cluster.CLIENT_ERRORS); afterwards every process is SERVING, both KV pools
drain once the fuzzers' ids are released, and greedy output still equals the in-process reference.
What the fuzzers found is pinned in test_hostile_regressions.py.
"""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from fuzz_cluster import (BRIDGE, CLIENT_ERRORS, HIDDEN, INLINE, LIVE, PROMPT, TIMEOUT, VOCAB, assert_finite_probs,
                          assert_tokens, expect_client_error, fuzz_settings, prefill_live, sometimes)
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate
from tandem.v1 import common_pb2, draft_pb2, rows_pb2, target_pb2

pytestmark = pytest.mark.slow

# --- strategies: mostly valid values, each field hostile a quarter of the time -----------------------
def maybe(strategy):
    return st.one_of(st.none(), strategy)


EDGE_FLOATS = [0.0, 0.5, 1.0, 2.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38]
f32 = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(width=32, allow_nan=True, allow_infinity=True))
uint32, uint64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
token = sometimes(st.integers(0, VOCAB - 1), uint32)
tokens = sometimes(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                   st.one_of(st.lists(token, max_size=12), st.sampled_from([300, 2047, 2048, 5000]).map(lambda n: [7] * n)))
small = sometimes(st.integers(0, 4), st.one_of(st.integers(0, 20), uint32))
rid = sometimes(st.sampled_from(["fz-0", "fz-1", "fz-2"]), st.one_of(
    st.just(LIVE), st.text(max_size=6).map("fz~".__add__), st.just("")))
enum = st.integers(0, 5)                       # every defined value and some undefined ones


@st.composite
def sampling(draw, valid: bool = False):
    def pick(ok, bad):
        return draw(ok if valid else sometimes(ok, bad))
    s = rows_pb2.SamplingParams(temperature=pick(st.sampled_from([0.0, 0.7, 1.0]), f32),
                                top_p=pick(st.sampled_from([0.0, 0.9]), f32),
                                top_k=pick(st.sampled_from([0, 5]), uint32))
    if valid or draw(st.booleans()):      # the live request is always seeded: its answers (and the draws
        s.seed = draw(uint64)             # that depend on them) replay exactly while hypothesis shrinks
    return s


@st.composite
def draft_probs(draw, k: int):
    """b"", random bytes, or k x V float32 filled with one value, perhaps one cell poisoned."""
    kind = draw(sometimes(st.sampled_from(["none", "full"]), st.sampled_from(["bytes", "odd", "poison"])))
    if kind == "none":
        return b""
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    fill = 1.0 / VOCAB if kind == "full" else draw(st.sampled_from([0.0, 1.0, 1e38]))
    q = np.full((k, VOCAB), fill, dtype="<f4")
    if k and kind == "poison":
        q[draw(st.integers(0, k - 1)), draw(st.integers(0, VOCAB - 1))] = draw(st.sampled_from(
            [math.nan, math.inf, -1.0, 3.4e38]))
    return q.tobytes()


@st.composite
def draft_top(draw, k: int) -> tuple[bytes, bytes]:
    """(draft_top_ids, draft_top_probs): none, random bytes of either, or k x w ids (some out of range) and
    probabilities (some poisoned)."""
    kind = draw(sometimes(st.sampled_from(["none", "good"]), st.sampled_from(["bytes", "ids", "poison"])))
    if kind == "none":
        return b"", b""
    if kind == "bytes":
        return draw(st.binary(max_size=64)), draw(st.binary(max_size=64))
    w = draw(st.integers(1, 8))
    ids = np.array(draw(st.lists(st.integers(0, VOCAB - 1), min_size=k * w, max_size=k * w)), dtype="<i4")
    probs = np.full(k * w, 1.0 / w, dtype="<f4")
    if k and kind == "ids":
        ids[draw(st.integers(0, k * w - 1))] = draw(st.sampled_from([VOCAB, -1, 2 ** 31 - 1]))
    if k and kind == "poison":
        probs[draw(st.integers(0, k * w - 1))] = draw(st.sampled_from([math.nan, math.inf, -1.0]))
    return ids.tobytes(), probs.tobytes()


@st.composite
def mutated(draw, desc: rows_pb2.HiddenRows) -> rows_pb2.HiddenRows:
    """A real descriptor with one or two fields made wrong (a NaN or inf in its rows counts as one)."""
    m = rows_pb2.HiddenRows()
    m.CopyFrom(desc)
    for field in draw(st.lists(st.sampled_from(
            ["num_rows", "rows_per_request", "used_rows_per_request", "request_ids", "hidden_size", "dtype",
             "layout", "transport", "nan", "inf", "truncate", "bytes", "transfer_id"]), min_size=1, max_size=2)):
        if field in ("num_rows", "hidden_size"):
            setattr(m, field, draw(small))
        elif field in ("rows_per_request", "used_rows_per_request"):
            m.ClearField(field)
            getattr(m, field).extend(draw(st.lists(small, max_size=3)))
        elif field == "request_ids":
            m.ClearField(field)
            m.request_ids.extend(draw(st.lists(rid, max_size=3)))
        elif field in ("dtype", "layout", "transport"):
            setattr(m, field, draw(enum))
            m.shard_count, m.shard_index, m.padded_num_rows = draw(small), draw(small), draw(small)
        elif field in ("nan", "inf") and m.inline_data and m.dtype == rows_pb2.DTYPE_FLOAT32:
            rows = np.frombuffer(m.inline_data, dtype="<f4").copy()
            rows[draw(st.integers(0, rows.size - 1))] = math.nan if field == "nan" else -math.inf
            m.inline_data = rows.tobytes()
        elif field == "truncate":
            m.inline_data = m.inline_data[: draw(st.integers(0, max(0, len(m.inline_data) - 1)))]
        elif field == "bytes":
            m.inline_data = draw(st.binary(max_size=64))
        elif field == "transfer_id":
            m.transport, m.transfer_id = BRIDGE, draw(uint64)
    return m


# --- helpers ------------------------------------------------------------------------------------
def call(what: str, fn, *args):
    """-> the response, or None after checking the failure is a client error."""
    try:
        resp = fn(*args, timeout=TIMEOUT)
    except grpc.RpcError as e:
        event(f"{what}: {e.code().name} {e.details()[:48]}")      # --hypothesis-show-statistics
        expect_client_error(e, what)
        return None
    event(f"{what}: OK")
    return resp


@pytest.fixture(scope="module")
def reference(fuzz_cluster):
    model = load_model(TargetModel, fuzz_cluster.ckpt)
    return lambda ids, n: greedy_generate(model, ids, n)


# --- fuzzers ------------------------------------------------------------------------------------
@fuzz_settings(150)
@given(items=sometimes(st.lists(st.tuples(rid, tokens, sampling(), maybe(small), st.booleans()), min_size=1,
                                max_size=3, unique_by=lambda x: x[0]),
                       st.lists(st.tuples(rid, tokens, sampling(), maybe(uint32), st.booleans()), max_size=3)),
       want_rows=st.booleans(), transport=enum)
def test_fuzz_prefill(fuzz_cluster, items, want_rows, transport):
    req = target_pb2.PrefillRequest(return_hidden_rows=want_rows, transport=transport, items=[
        target_pb2.PrefillItem(request_id=r, prompt_token_ids=t, sampling=s, logprobs=lp, prompt_logprobs=p)
        for r, t, s, lp, p in items])
    try:
        resp = call("Prefill", fuzz_cluster.target.Prefill, req)
        if resp is not None:
            assert len(resp.first_token_ids) == len(items)
            assert_tokens(resp.first_token_ids, "Prefill first_token_ids")
            for lp in resp.logprobs:
                for e in list(lp.prompt) + [lp.first_token]:
                    assert_tokens(e.top_token_ids, "Prefill logprobs")
                    assert not math.isnan(e.logprob), "Prefill logprobs: NaN"
    finally:
        fuzz_cluster.release({r for r, *_ in items})


@fuzz_settings(100)
@given(live=sampling(valid=True), items=sometimes(
           st.lists(st.tuples(rid, tokens, sampling(), maybe(small), st.booleans()), min_size=1, max_size=3,
                    unique_by=lambda x: x[0]),
           st.lists(st.tuples(sometimes(rid, st.just(LIVE)), tokens, sampling(), maybe(uint32), st.booleans()),
                    max_size=3)),
       chunk=maybe(small), want_rows=st.booleans(), transport=enum)
def test_fuzz_verify_with_a_prefill_riding_it(fuzz_cluster, live, items, chunk, want_rows, transport):
    """A valid Verify carrying a hostile Prefill (VerifyRequest.prefill): the Verify is answered whatever the
    prefill holds; the prefill is answered as a Prefill call would be, or refused alone with a client error
    (prefill_status), never failing the round."""
    c, used = fuzz_cluster, {LIVE} | {r for r, *_ in items}
    try:
        prefill_live(c, live)
        pre = target_pb2.PrefillRequest(return_hidden_rows=want_rows, transport=transport, items=[
            target_pb2.PrefillItem(request_id=r, prompt_token_ids=t, sampling=s, logprobs=lp, prompt_logprobs=p,
                                   max_chunk_tokens=chunk or 0) for r, t, s, lp, p in items])
        resp = c.target.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id=LIVE)],
                                                        prefill=pre), timeout=TIMEOUT)
        assert [len(r.emitted_token_ids) for r in resp.results] == [1]
        assert_tokens(resp.results[0].emitted_token_ids, "Verify emitted_token_ids")
        if resp.prefill_status.code:
            code = next(c for c in grpc.StatusCode if c.value[0] == resp.prefill_status.code)
            event(f"riding Prefill refused: {code.name}")
            assert code in CLIENT_ERRORS and not resp.HasField("prefill") and resp.prefill_status.message
        else:
            event("riding Prefill answered")
            assert len(resp.prefill.first_token_ids) == len(items)
            assert_tokens(resp.prefill.first_token_ids, "riding Prefill first_token_ids")
    finally:
        fuzz_cluster.release(used)


@fuzz_settings(150)
@given(data=st.data(), live=sampling(valid=True), rounds=st.integers(1, 2))
def test_fuzz_verify(fuzz_cluster, data, live, rounds):
    used = {LIVE}
    try:
        prefill_live(fuzz_cluster, live)
        for _ in range(rounds):
            items = []
            drafts_of = sometimes(st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(token, max_size=18))
            for r, drafts, lp in data.draw(st.lists(st.tuples(sometimes(st.just(LIVE), rid), drafts_of,
                                                              maybe(small)), min_size=1, max_size=2)):
                used.add(r)
                top_ids, top_probs = data.draw(draft_top(len(drafts)))
                items.append(target_pb2.VerifyItem(request_id=r, draft_token_ids=drafts, logprobs=lp,
                                                   draft_probs=data.draw(draft_probs(len(drafts))),
                                                   draft_top_ids=top_ids, draft_top_probs=top_probs))
            resp = call("Verify", fuzz_cluster.target.Verify, target_pb2.VerifyRequest(
                items=items, return_hidden_rows=data.draw(st.booleans()), transport=data.draw(enum)))
            for it, res in zip(items, resp.results if resp else []):
                assert res.num_accepted <= len(it.draft_token_ids) and len(res.emitted_token_ids) == res.num_accepted + 1
                assert_tokens(res.emitted_token_ids, "Verify emitted_token_ids")
    finally:
        fuzz_cluster.release(used)


ASPECTS = ["new", "k", "sampling", "position", "rows", "extra_items", "extra_rows"]


@fuzz_settings(200)
@given(data=st.data(), live=sampling(valid=True), transport=st.sampled_from([INLINE, BRIDGE]), running=st.booleans(),
       bad=sometimes(st.just([]), st.lists(st.sampled_from(ASPECTS), min_size=1, max_size=2)))
def test_fuzz_propose(fuzz_cluster, data, live, transport, running, bad):
    """A new request's first Propose, or (running) a request one round in, with `bad` aspects hostile."""
    c = fuzz_cluster
    used = {LIVE}
    try:
        resp = prefill_live(c, live, transport)
        new, position, rows = PROMPT + list(resp.first_token_ids), 0, resp.hidden_rows
        if running:                       # a valid round first: Propose -> Verify, then fuzz the next Propose
            out = c.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id=LIVE, new_token_ids=new, num_draft_tokens=2, sampling=live)], hidden_rows=[rows]),
                timeout=TIMEOUT).results[0]
            v = c.target.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
                request_id=LIVE, draft_token_ids=out.draft_token_ids, draft_probs=out.draft_probs,
                draft_top_ids=out.draft_top_ids, draft_top_probs=out.draft_top_probs)],
                return_hidden_rows=True, transport=transport), timeout=TIMEOUT)
            new, position, rows = list(v.results[0].emitted_token_ids), len(new), v.hidden_rows
        draw = data.draw
        items = [draft_pb2.ProposeItem(
            request_id=LIVE, new_token_ids=draw(tokens) if "new" in bad else new,
            num_draft_tokens=draw(st.one_of(st.integers(5, 40), uint32) if "k" in bad else st.integers(0, 4)),
            sampling=draw(sampling()) if "sampling" in bad else live,
            position=draw(small) if "position" in bad else position)]
        for r in (draw(st.lists(rid, min_size=1, max_size=2)) if "extra_items" in bad else []):
            used.add(r)
            items.append(draft_pb2.ProposeItem(request_id=r, new_token_ids=draw(tokens), position=draw(small),
                                               num_draft_tokens=draw(small), sampling=draw(sampling())))
        rows = [draw(mutated(rows)) if "rows" in bad else rows]
        if "extra_rows" in bad:
            rows += draw(st.lists(st.builds(
                rows_pb2.HiddenRows, num_rows=small, request_ids=st.lists(rid, max_size=2), hidden_size=st.just(HIDDEN),
                dtype=enum, layout=enum, transport=enum, inline_data=st.binary(max_size=512), transfer_id=uint64),
                min_size=1, max_size=2))
        out = call("Propose", c.draft.Propose, draft_pb2.ProposeRequest(items=items, hidden_rows=rows))
        for it, res in zip(items, out.results if out else []):
            assert len(res.draft_token_ids) == it.num_draft_tokens
            assert_tokens(res.draft_token_ids, "Propose draft_token_ids")
            assert_finite_probs(res.draft_probs, "Propose")
            assert_finite_probs(res.draft_top_probs, "Propose")
            assert_tokens(np.frombuffer(res.draft_top_ids, "<i4").tolist(), "Propose draft_top_ids")
    finally:
        c.release(used)


@fuzz_settings(80)
@given(data=st.data(), bad=sometimes(st.just([]), st.lists(st.sampled_from(["tokens", "ids", "extra"]), min_size=1,
                                                           max_size=2)))
def test_fuzz_recompute_rows(fuzz_cluster, data, bad):
    """RecomputeRows (the draft's re-sync after a restart): a running request's committed tokens, or not."""
    c, used = fuzz_cluster, {LIVE}
    try:
        first = prefill_live(c, rows_pb2.SamplingParams()).first_token_ids
        committed = PROMPT + list(first)
        out_of_vocab = [committed[0], 4_000_000_000] + committed[2:]      # the right count, the right last token
        toks = data.draw(sometimes(st.just(out_of_vocab), tokens)) if "tokens" in bad else committed
        items = [target_pb2.RecomputeItem(request_id=data.draw(rid) if "ids" in bad else LIVE, token_ids=toks)]
        if "extra" in bad:
            items += [target_pb2.RecomputeItem(request_id=r, token_ids=data.draw(tokens))
                      for r in data.draw(st.lists(rid, min_size=1, max_size=2))]
        used |= {it.request_id for it in items}
        resp = call("RecomputeRows", c.target.RecomputeRows, target_pb2.RecomputeRowsRequest(
            items=items, transport=data.draw(st.sampled_from([INLINE, BRIDGE]))))
        if resp is not None:
            assert list(resp.hidden_rows.rows_per_request) == [len(it.token_ids) - 1 for it in items]
        assert c.info(c.target).running_requests == 1, "RecomputeRows must not add or drop requests"
    finally:
        c.release(used)


@fuzz_settings(40)
@given(ids=st.one_of(st.lists(rid, max_size=5), st.integers(0, 20000).map(lambda n: [f"fz-{i}" for i in range(n)])))
def test_fuzz_release_and_info(fuzz_cluster, ids):
    for stub in (fuzz_cluster.target, fuzz_cluster.draft):
        resp = call("Release", stub.Release, common_pb2.ReleaseRequest(request_ids=ids))
        assert resp is not None and resp.released == 0        # none of them is running
        assert fuzz_cluster.info(stub).vocab_size == VOCAB


def test_services_sound_after_fuzzing(fuzz_cluster, reference):
    """Last in the file: alive, SERVING, no KV block left, and the output still exact."""
    fuzz_cluster.assert_healthy()
    fuzz_cluster.cluster.wait_drained()
    prompt = [3, 14, 15, 92, 65]
    assert fuzz_cluster.greedy(prompt, 12) == reference(prompt, 12)
