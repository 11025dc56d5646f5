"""The hidden-row contract, raw gRPC against a running cluster's draft and target.

Real rows come from Target.Prefill / Verify; the tests then hand the draft descriptors that
disagree with its bookkeeping (or with their own payload) and expect the documented status with
the request and both counts in the message — before any row is touched, never a hang. After each,
a correct Prefill -> Propose -> Verify sequence for a fresh request must still give the in-process
greedy reference, and every process must still answer health SERVING.
"""
from __future__ import annotations

import itertools
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from bridge_checks import assert_bridge_contract
from cluster import Cluster, make_checkpoint, serve_module
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate
from tandem.v1 import common_pb2, draft_pb2, generate_pb2, rows_pb2, target_pb2

pytestmark = pytest.mark.slow

K = 2
SEED = 5
INLINE, BRIDGE = rows_pb2.TRANSPORT_INLINE, rows_pb2.TRANSPORT_BRIDGE
BRIDGE_TIMEOUT_S = 10.0      # the draft's --bridge-timeout-s default: a contract error must come well before
TIMEOUT = 30
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=SEED)


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory, request):
    with Cluster(ckpt, k=K, gateways=[{"hidden_transport": "gloo"}], log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield from serve_module(c, request)


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return load_model(TargetModel, ckpt)


@pytest.fixture(scope="module")
def hidden_size(cluster):
    return cluster.target.GetInfo(common_pb2.InfoRequest(), timeout=TIMEOUT).hidden_size


# --- raw calls ---------------------------------------------------------------------------------
def rid(tag: str) -> str:
    return f"contract-{tag}-{next(_ids)}"


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 101) % 500 for i in range(n)]


def prefill(c, request_id: str, prompt: list[int], transport=INLINE) -> target_pb2.PrefillResponse:
    return c.target.Prefill(target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(request_id=request_id, prompt_token_ids=prompt)],
        return_hidden_rows=True, transport=transport), timeout=TIMEOUT)


def propose(c, request_id: str, new_tokens: list[int], position: int, rows: list[rows_pb2.HiddenRows], k=K,
            cached: int = 0, rows_set: int = 0):
    return c.draft.Propose(draft_pb2.ProposeRequest(
        items=[draft_pb2.ProposeItem(request_id=request_id, new_token_ids=new_tokens, num_draft_tokens=k,
                                     position=position, cached_tokens=cached, rows_set=rows_set)], hidden_rows=rows),
        timeout=TIMEOUT)


def verify(c, request_id: str, drafts: list[int], transport=INLINE, draft_probs: bytes = b""):
    return c.target.Verify(target_pb2.VerifyRequest(
        items=[target_pb2.VerifyItem(request_id=request_id, draft_token_ids=drafts, draft_probs=draft_probs)],
        return_hidden_rows=True, transport=transport), timeout=TIMEOUT)


def refused(call, code: grpc.StatusCode, *needles: str) -> str:
    """Run `call`, expect `code`, every needle in the message, and an answer well inside the bridge
    timeout (a contract check must not wait for rows). -> the message."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        call()
    took = time.monotonic() - t0
    msg = e.value.details()
    assert e.value.code() == code, f"expected {code.name}, got {e.value.code().name}: {msg}"
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert took < BRIDGE_TIMEOUT_S / 2, f"the refusal took {took:.1f}s: it waited on the bridge"
    return msg


def with_rows(desc: rows_pb2.HiddenRows, **changes) -> rows_pb2.HiddenRows:
    out = rows_pb2.HiddenRows()
    out.CopyFrom(desc)
    for name, value in changes.items():
        if isinstance(value, list):
            out.ClearField(name)
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out


def row_bytes(hidden_size: int) -> int:
    return hidden_size * 4                       # float32 services


def drive(c, request_id: str, prompt: list[int], n: int, transport=INLINE, k=K) -> tuple[list[int], int]:
    """The gateway's round by hand: Prefill, then Propose -> Verify until n tokens; checks every row
    descriptor on the way. -> (n tokens, drafts accepted)."""
    try:
        pre = prefill(c, request_id, prompt, transport)
        rows, cached = pre.hidden_rows, pre.num_cached_tokens[0]       # a prompt seen before: prefix hit
        assert (rows.transport, list(rows.request_ids), list(rows.rows_per_request), rows.num_rows) == \
            (transport, [request_id], [len(prompt) - cached], len(prompt) - cached)
        tokens, new, position, accepted = list(pre.first_token_ids), prompt + list(pre.first_token_ids), 0, 0
        while len(tokens) < n:
            drafts = list(propose(c, request_id, new, position, [rows], k, cached).results[0].draft_token_ids)
            cached = 0
            assert len(drafts) == k
            position += len(new)
            v = verify(c, request_id, drafts, transport)
            a, new, rows = v.results[0].num_accepted, list(v.results[0].emitted_token_ids), v.hidden_rows
            assert len(new) == a + 1 and new[:a] == drafts[:a]
            # the committed tokens' rows (over gloo they go after the acceptance; a ring pushes every verified
            # token's before it: tests/test_propose_ahead.py)
            m = a + 1
            assert (list(rows.rows_per_request), rows.num_rows, rows.transport) == ([m], m, transport)
            assert not rows.used_rows_per_request
            tokens += new
            accepted += a
        return tokens[:n], accepted
    finally:
        c.release([request_id])


def assert_still_serves(c, ref_model, transport=INLINE) -> None:
    prompt = prompt_of(13, salt=next(_ids))
    got, _ = drive(c, rid("good"), prompt, 12, transport)
    assert got == greedy_generate(ref_model, prompt, 12), "a good sequence after a refused one went wrong"
    for name, addr in c.addrs().items():
        assert c.health(addr) == health_pb2.HealthCheckResponse.SERVING, name


# --- tests -------------------------------------------------------------------------------------
def test_reflection_lists_services(cluster):
    want = {"target": "tandem.v1.TargetService", "draft": "tandem.v1.DraftService",
            cluster.gateways[0].name: "tandem.v1.GenerateService"}
    for name, addr in cluster.addrs().items():
        ch = grpc.insecure_channel(addr)
        try:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        finally:
            ch.close()
        assert {want[name], "grpc.health.v1.Health"} <= services, f"{name}: {services}"


def test_good_sequences_match_reference(cluster, ref_model):
    """The raw round itself (both transports) is lossless and accepts drafts (the checkpoint's
    draft follows the target's bigram part of the time), so the refusals below are against a
    working path."""
    accepted = 0
    for transport in (INLINE, BRIDGE):
        for n_prompt in (1, 7, 30):
            prompt = prompt_of(n_prompt, salt=n_prompt)
            got, a = drive(cluster, rid("ref"), prompt, 16, transport)
            assert got == greedy_generate(ref_model, prompt, 16), (transport, n_prompt)
            accepted += a
    assert accepted > 0, "no draft was ever accepted: the raw round is not exercising acceptance"


def test_rows_per_request_disagrees_with_new_tokens(cluster, ref_model, hidden_size):
    """A new request brings prompt + first token (T + 1 tokens) and needs T rows; a descriptor that
    claims T - 1 (self-consistent: num_rows and payload also T - 1) is INVALID_ARGUMENT."""
    T, r = 9, rid("rpr")
    try:
        pre = prefill(cluster, r, prompt_of(T))
        rows = pre.hidden_rows
        short = with_rows(rows, rows_per_request=[T - 1], num_rows=T - 1,
                          inline_data=rows.inline_data[: (T - 1) * row_bytes(hidden_size)])
        new = prompt_of(T) + list(pre.first_token_ids)
        refused(lambda: propose(cluster, r, new, 0, [short]), grpc.StatusCode.INVALID_ARGUMENT,
                repr(r), f"rows_per_request is {T - 1}", f"expected {T}")
        # the refusal left no state behind: the same request proceeds with its real rows
        assert len(propose(cluster, r, new, 0, [rows]).results[0].draft_token_ids) == K
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_an_item_reads_the_row_set_it_names(cluster, ref_model, hidden_size):
    """Two row sets name the request (a Verify's set names every request of its batch, one the draft did not
    follow among them): the item's rows_set says which one it reads, the other is not read for it. Without
    rows_set that is refused, as is a rows_set past the call's sets; with it the drafts are those of the
    request's own rows alone."""
    T, r, r2 = 9, rid("set"), rid("set")
    try:
        pre = prefill(cluster, r, prompt_of(T, 5))
        rows = pre.hidden_rows
        decoy = with_rows(rows, rows_per_request=[1], num_rows=1, inline_data=rows.inline_data[:row_bytes(hidden_size)])
        new = prompt_of(T, 5) + list(pre.first_token_ids)
        refused(lambda: propose(cluster, r, new, 0, [decoy, rows]), grpc.StatusCode.INVALID_ARGUMENT, repr(r))
        refused(lambda: propose(cluster, r, new, 0, [decoy, rows], rows_set=3), grpc.StatusCode.INVALID_ARGUMENT,
                "rows_set is 3", "2 hidden row sets")
        got = list(propose(cluster, r, new, 0, [decoy, rows], rows_set=2).results[0].draft_token_ids)
        pre2 = prefill(cluster, r2, prompt_of(T, 5))
        want = list(propose(cluster, r2, prompt_of(T, 5) + list(pre2.first_token_ids), 0, [pre2.hidden_rows])
                    .results[0].draft_token_ids)
        assert got == want and len(got) == K
    finally:
        cluster.release([r, r2])
    assert_still_serves(cluster, ref_model)


def test_round_rows_disagree_with_accepted(cluster, ref_model, hidden_size):
    """After a round that emitted a + 1 tokens the draft needs a + 1 rows; one more is refused."""
    T, r = 6, rid("round")
    try:
        pre = prefill(cluster, r, prompt_of(T, 3))
        new = prompt_of(T, 3) + list(pre.first_token_ids)
        drafts = list(propose(cluster, r, new, 0, [pre.hidden_rows]).results[0].draft_token_ids)
        v = verify(cluster, r, drafts)
        a, emitted = v.results[0].num_accepted, list(v.results[0].emitted_token_ids)
        extra = with_rows(v.hidden_rows, rows_per_request=[a + 2], num_rows=a + 2,
                          inline_data=v.hidden_rows.inline_data + v.hidden_rows.inline_data[:row_bytes(hidden_size)])
        refused(lambda: propose(cluster, r, emitted, T + 1, [extra]), grpc.StatusCode.INVALID_ARGUMENT,
                repr(r), f"rows_per_request is {a + 2}", f"expected {a + 1}")
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_inline_payload_short_of_num_rows(cluster, ref_model, hidden_size):
    T, r = 11, rid("short")
    try:
        pre = prefill(cluster, r, prompt_of(T, 1))
        rows = pre.hidden_rows
        lying = with_rows(rows, inline_data=rows.inline_data[: (T - 2) * row_bytes(hidden_size)])
        refused(lambda: propose(cluster, r, prompt_of(T, 1) + list(pre.first_token_ids), 0, [lying]),
                grpc.StatusCode.INVALID_ARGUMENT, f"holds {T - 2} rows", f"num_rows is {T}")
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_propose_for_released_request(cluster, ref_model):
    T, r = 5, rid("released")
    try:
        pre = prefill(cluster, r, prompt_of(T, 2))
        new = prompt_of(T, 2) + list(pre.first_token_ids)
        drafts = list(propose(cluster, r, new, 0, [pre.hidden_rows]).results[0].draft_token_ids)
        v = verify(cluster, r, drafts)
        assert cluster.draft.Release(common_pb2.ReleaseRequest(request_ids=[r]), timeout=TIMEOUT).released == 1
        refused(lambda: propose(cluster, r, list(v.results[0].emitted_token_ids), T + 1, [v.hidden_rows]),
                grpc.StatusCode.FAILED_PRECONDITION, repr(r), f"position is {T + 1}", "released")
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_bridge_descriptor_disagrees(cluster, ref_model):
    """Rows on the bridge: the descriptor is checked before a receive is posted, so a bad one is
    refused at once (not after the bridge timeout), and the next bridge transfer is unaffected."""
    T, r = 8, rid("bridge")
    try:
        pre = prefill(cluster, r, prompt_of(T, 4), BRIDGE)
        rows = pre.hidden_rows
        assert rows.transport == BRIDGE and rows.transfer_id > 0 and not rows.inline_data
        new = prompt_of(T, 4) + list(pre.first_token_ids)
        refused(lambda: propose(cluster, r, new, 0, [with_rows(rows, num_rows=T + 1)]),
                grpc.StatusCode.INVALID_ARGUMENT, f"num_rows is {T + 1}", f"sums to {T}")
        refused(lambda: propose(cluster, r, new, 0, [with_rows(rows, num_rows=T - 1, rows_per_request=[T - 1])]),
                grpc.StatusCode.INVALID_ARGUMENT, repr(r), f"rows_per_request is {T - 1}", f"expected {T}")
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model, BRIDGE)
    assert_still_serves(cluster, ref_model, INLINE)


def test_used_rows_per_request_is_checked_like_every_count(cluster, ref_model):
    """HiddenRows.used_rows_per_request (of each request's rows the draft reads the first n: a ring pushes a Verify's
    every verified row before its acceptance) is checked like the other counts: one other than the committed
    tokens', over the request's rows, or one per request missing is refused naming the field and both counts; the
    correct one then takes the rows."""
    T, r = 6, rid("used")
    try:
        pre = prefill(cluster, r, prompt_of(T, 8), BRIDGE)
        drafts = list(propose(cluster, r, prompt_of(T, 8) + list(pre.first_token_ids), 0,
                              [pre.hidden_rows]).results[0].draft_token_ids)
        v = verify(cluster, r, drafts, BRIDGE)
        a, emitted, rows = v.results[0].num_accepted, list(v.results[0].emitted_token_ids), v.hidden_rows
        assert list(rows.rows_per_request) == [a + 1] and not rows.used_rows_per_request     # gloo: after
        refused(lambda: propose(cluster, r, emitted, T + 1, [with_rows(rows, used_rows_per_request=[a])]),
                grpc.StatusCode.INVALID_ARGUMENT, repr(r), f"used_rows_per_request is {a}", f"expected {a + 1}")
        refused(lambda: propose(cluster, r, emitted, T + 1, [with_rows(rows, used_rows_per_request=[a + 2])]),
                grpc.StatusCode.INVALID_ARGUMENT, f"used_rows_per_request is {a + 2}", f"rows_per_request {a + 1}")
        refused(lambda: propose(cluster, r, emitted, T + 1, [with_rows(rows, used_rows_per_request=[a + 1, 1])]),
                grpc.StatusCode.INVALID_ARGUMENT, "used_rows_per_request has 2 entries for 1 requests")
        ok = with_rows(rows, used_rows_per_request=[a + 1])
        assert len(propose(cluster, r, emitted, T + 1, [ok]).results[0].draft_token_ids) == K
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model, BRIDGE)


def test_bridge_contract_as_the_gpu_tests_check_it(cluster):
    """cluster.assert_bridge_contract, which tests/test_gpu*.py run over NCCL and CUDA IPC, here over gloo:
    the bad descriptor is refused naming the request and both counts, and the same transfer is then
    taken by a correct Propose."""
    r = rid("gpu-check")
    try:
        rows, item = assert_bridge_contract(cluster.target, cluster.draft, r, prompt_of(6, 7))
        good = cluster.draft.Propose(draft_pb2.ProposeRequest(items=[item], hidden_rows=[rows]), timeout=TIMEOUT)
        assert len(good.results[0].draft_token_ids) == 2
    finally:
        cluster.release([r])


def test_bridge_frame_disagrees_with_descriptor(cluster, ref_model):
    """A descriptor that matches the draft's bookkeeping but names another transfer's frame (which
    holds a different number of rows): the rows that arrive are checked before use."""
    ra, rb, Ta, Tb = rid("frame-a"), rid("frame-b"), 4, 10
    try:
        pa = prefill(cluster, ra, prompt_of(Ta, 5), BRIDGE)
        pb = prefill(cluster, rb, prompt_of(Tb, 6), BRIDGE)
        wrong = with_rows(pa.hidden_rows, transfer_id=pb.hidden_rows.transfer_id)
        refused(lambda: propose(cluster, ra, prompt_of(Ta, 5) + list(pa.first_token_ids), 0, [wrong]),
                grpc.StatusCode.INVALID_ARGUMENT, f"carried {Tb} rows", f"num_rows {Ta}")
    finally:
        cluster.release([ra, rb])
    assert_still_serves(cluster, ref_model, BRIDGE)


def sharded(d: rows_pb2.HiddenRows, h: int) -> rows_pb2.HiddenRows:
    """A well-formed SEQUENCE_SHARDED descriptor (shard 0 of 2, its half of the padded rows)."""
    padded = d.num_rows + d.num_rows % 2
    return with_rows(d, layout=rows_pb2.ROW_LAYOUT_SEQUENCE_SHARDED, shard_index=0, shard_count=2,
                     padded_num_rows=padded, num_rows=padded // 2,
                     inline_data=d.inline_data[: padded // 2 * row_bytes(h)])


BAD_DESCRIPTORS = [
    ("hidden_size", lambda d, h: with_rows(d, hidden_size=h + 1), "hidden_size is"),
    ("dtype", lambda d, h: with_rows(d, dtype=rows_pb2.DTYPE_BFLOAT16), "dtype is DTYPE_BFLOAT16"),
    ("layout", lambda d, h: sharded(d, h), "the draft takes FULL rows"),
    ("ids vs counts", lambda d, h: with_rows(d, rows_per_request=list(d.rows_per_request) + [0]), "request_ids has 1"),
    ("transport", lambda d, h: with_rows(d, transport=rows_pb2.TRANSPORT_UNSPECIFIED), "transport"),
]


@pytest.mark.parametrize("case", BAD_DESCRIPTORS, ids=[b[0] for b in BAD_DESCRIPTORS])
def test_other_descriptor_lies(cluster, ref_model, hidden_size, case):
    _, mutate, needle = case
    T, r = 7, rid("desc")
    try:
        pre = prefill(cluster, r, prompt_of(T, 7))
        refused(lambda: propose(cluster, r, prompt_of(T, 7) + list(pre.first_token_ids), 0,
                                [mutate(pre.hidden_rows, hidden_size)]), grpc.StatusCode.INVALID_ARGUMENT, needle)
        # no row set at all for a request that needs T rows
        refused(lambda: propose(cluster, r, prompt_of(T, 7) + list(pre.first_token_ids), 0, []),
                grpc.StatusCode.INVALID_ARGUMENT, repr(r), f"needs {T} rows")
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_verify_unknown_request(cluster, ref_model):
    r = rid("unknown")
    refused(lambda: verify(cluster, r, [5, 6]), grpc.StatusCode.FAILED_PRECONDITION, repr(r))
    assert_still_serves(cluster, ref_model)


def test_verify_draft_probs_of_wrong_size(cluster, ref_model):
    info = cluster.target.GetInfo(common_pb2.InfoRequest(), timeout=TIMEOUT)
    V, T, r = info.vocab_size, 6, rid("probs")
    prompt = prompt_of(T, 8)
    try:
        pre = prefill(cluster, r, prompt)
        drafts = list(propose(cluster, r, prompt + list(pre.first_token_ids), 0, [pre.hidden_rows])
                      .results[0].draft_token_ids)
        refused(lambda: verify(cluster, r, drafts, draft_probs=b"\x00" * (4 * V)), grpc.StatusCode.INVALID_ARGUMENT,
                repr(r), f"{4 * V} bytes", f"{K} x {V}", str(K * V * 4))
        # nothing was committed by the refused Verify: the request continues where it was
        v = verify(cluster, r, drafts)
        got = list(pre.first_token_ids) + list(v.results[0].emitted_token_ids)
        assert got == greedy_generate(ref_model, prompt, len(got))
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)


def test_gateway_still_serves(cluster, ref_model):
    prompt = prompt_of(9, 9)
    want = greedy_generate(ref_model, prompt, 14)
    for k in (0, K):
        r = cluster.gateways[0].stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=14, ignore_eos=True,
            num_speculative_tokens=k), timeout=TIMEOUT)
        assert list(r.token_ids) == want, f"K={k}"
    cluster.wait_drained()                              # every test released what it made


def test_sampled_drafts_travel_as_their_top_tokens(cluster, ref_model):
    """A sampled Propose sends each draft token's distribution as its most probable tokens (draft_top_ids /
    draft_top_probs, a few KB) instead of vocab floats; the target takes them, and refuses malformed ones naming
    the field, before anything is committed."""
    import numpy as np
    from infra.defaults import DRAFT_Q_WIDTH
    V, T, r = cluster.target.GetInfo(common_pb2.InfoRequest(), timeout=TIMEOUT).vocab_size, 6, rid("top")
    samp = rows_pb2.SamplingParams(temperature=1.0, seed=11)
    prompt = prompt_of(T, 12)
    try:
        pre = cluster.target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id=r, prompt_token_ids=prompt, sampling=samp)], return_hidden_rows=True,
            transport=INLINE), timeout=TIMEOUT)
        res = cluster.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
            request_id=r, new_token_ids=prompt + list(pre.first_token_ids), num_draft_tokens=K, sampling=samp)],
            hidden_rows=[pre.hidden_rows]), timeout=TIMEOUT).results[0]
        drafts = list(res.draft_token_ids)
        assert len(drafts) == K and not res.draft_probs
        w = len(res.draft_top_ids) // (4 * K)
        assert len(res.draft_top_ids) == len(res.draft_top_probs) == 4 * K * w and 1 <= w <= min(V, DRAFT_Q_WIDTH)
        ids = np.frombuffer(res.draft_top_ids, "<i4").reshape(K, w)
        probs = np.frombuffer(res.draft_top_probs, "<f4").reshape(K, w)
        assert np.allclose(probs.sum(1), 1, atol=1e-5) and (probs >= 0).all() and (ids < V).all()
        for j, t in enumerate(drafts):               # each draft was drawn from its own (cut) distribution
            assert probs[j][ids[j] == t].sum() > 0, (j, t)

        def verify_top(top_ids: bytes, top_probs: bytes, dense: bytes = b""):
            return cluster.target.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
                request_id=r, draft_token_ids=drafts, draft_top_ids=top_ids, draft_top_probs=top_probs,
                draft_probs=dense)], return_hidden_rows=True, transport=INLINE), timeout=TIMEOUT)
        bad_ids = ids.copy()
        bad_ids[0, 0] = V
        for args, needles in (((res.draft_top_ids[:-4], res.draft_top_probs), ("draft_top_ids", "k = 2")),
                              ((bad_ids.astype("<i4").tobytes(), res.draft_top_probs), ("below the vocabulary",)),
                              ((res.draft_top_ids, (-probs).astype("<f4").tobytes()), ("draft_top_probs",)),
                              ((res.draft_top_ids, res.draft_top_probs, b"\x00" * (4 * K * V)), ("both set",))):
            refused(lambda: verify_top(*args), grpc.StatusCode.INVALID_ARGUMENT, repr(r), *needles)
        v = verify_top(res.draft_top_ids, res.draft_top_probs).results[0]
        assert 0 <= v.num_accepted <= K and len(v.emitted_token_ids) == v.num_accepted + 1
        assert list(v.emitted_token_ids)[:v.num_accepted] == drafts[:v.num_accepted]
    finally:
        cluster.release([r])
    assert_still_serves(cluster, ref_model)
