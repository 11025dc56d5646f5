"""The next Verify laid out while the draft proposes (services/target/layout_ahead.py): a target that lays out each
next step ahead, right or wrong, answers every Verify as one that never does, bit for bit, with the same cache."""
from __future__ import annotations

import random

import pytest
import torch

from services.sampling import Sampling
from services.target import layout_ahead
from tests.test_engines import engines, make_models

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": [21, 22, 23, 24, 25, 26, 27], "d": [31, 32]}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def twins(device: str = "cpu"):
    """Two targets on one model (on CUDA as served: steps laid out into CUDA graphs' buffers); drafts accepted at
    random (synthetic acceptance 0.7, the same draws on both: random weights accept almost none), so the positions
    move unevenly from round to round."""
    target, draft = make_models(head_std=0.5)
    (plain, _), (ahead, _) = engines(target.to(device), draft.to(device)), engines(target, draft)
    for te in (plain, ahead):
        if device == "cuda":
            from models import cuda_graphs
            cuda_graphs.enable(te)
        te.synthetic_acceptance = (0.7,)
        te.prefill([(r, p, Sampling(seed=i)) for i, (r, p) in enumerate(PROMPTS.items())])
    return plain, ahead


def same(plain, ahead, items) -> None:
    """One Verify on both: the same acceptance, tokens and rows; the same cache lengths after."""
    want, got = plain.verify(items), ahead.verify(items)
    assert got.accepted == want.accepted and got.emitted == want.emitted
    assert torch.equal(got.rows, want.rows)
    ids = list(PROMPTS)
    assert [ahead.cache.length(r) for r in ids if r in ahead.cache] == \
        [plain.cache.length(r) for r in ids if r in plain.cache]
    assert ahead.cache.num_free_blocks == plain.cache.num_free_blocks


def drafts(te, rng, ids, ks):
    return [(r, [rng.randrange(3, te.vocab_size) for _ in range(k)], None) for r, k in zip(ids, ks)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_laid_out_ahead_is_the_step_laid_out_then(device):
    """Rounds over four requests, each next step laid out ahead as planned: every Verify takes it and answers as
    the plain target does, rows included."""
    plain, ahead = twins(device)
    rng, ids, ks = random.Random(0), list(PROMPTS), [3, 2, 3, 1]
    for _ in range(8):
        items = drafts(plain, rng, ids, ks)
        same(plain, ahead, items)
        layout_ahead.lay_out(ahead, ids, ks)
    assert ahead.laid_ahead == [7, 0]
    assert len({len(ahead.requests[r].tokens) for r in ids}) > 1          # (the positions moved unevenly)


@pytest.mark.parametrize("between", ["fewer_drafts", "a_request_ended", "another_order", "prefill", "release",
                                     "recompute_rows", "past_max_model_len"])
def test_a_step_laid_out_ahead_that_is_not_the_next_is_put_back(between):
    """The plan and the next Verify differ (or a call comes between them): the extension is put back first, and
    the Verify answers as the plain target's."""
    plain, ahead = twins()
    rng, ids, ks = random.Random(1), list(PROMPTS), [3, 3, 3, 3]
    same(plain, ahead, drafts(plain, rng, ids, ks))
    layout_ahead.lay_out(ahead, ids, [2, 2, 2, 2] if between == "past_max_model_len" else ks)
    if between == "past_max_model_len":                   # no layout where the step would not fit
        ahead.max_model_len = ahead.requests["a"].num_tokens + 1
        layout_ahead.lay_out(ahead, ids, ks)
        assert ahead.laid is None and ahead.laid_ahead == [0, 1]
        ahead.max_model_len = plain.max_model_len
    elif between == "fewer_drafts":
        ks = [3, 1, 3, 3]
    elif between == "a_request_ended":
        ids, ks = ids[1:], ks[1:]
    elif between == "another_order":
        ids = ids[::-1]
    elif between == "prefill":
        for te in (plain, ahead):
            te.prefill([("e", [41, 42, 43], Sampling(seed=9))])
        ids, ks = ids + ["e"], ks + [2]
    elif between == "release":
        for te in (plain, ahead):
            assert te.release(["b"]) == 1
        ids, ks = [r for r in ids if r != "b"], [3, 3, 3]
    elif between == "recompute_rows":
        r = ahead.requests["a"]
        torch.testing.assert_close(ahead.recompute_rows([("a", list(r.tokens))]),
                                   plain.recompute_rows([("a", list(plain.requests["a"].tokens))]))
    assert ahead.laid is None or between in ("fewer_drafts", "a_request_ended", "another_order")
    for _ in range(3):
        same(plain, ahead, drafts(plain, rng, ids, ks))
        layout_ahead.lay_out(ahead, ids, ks)
    assert ahead.laid_ahead[0] == 2 and ahead.laid_ahead[1] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_laid_step_is_not_taken_after_another_layout(device):
    """A step laid out after the plan (here: directly on the cache) may have reused the graph's buffers: the plan
    is put back, not taken."""
    plain, ahead = twins(device)
    rng, ids, ks = random.Random(2), list(PROMPTS), [2, 2, 2, 2]
    same(plain, ahead, drafts(plain, rng, ids, ks))
    layout_ahead.lay_out(ahead, ids, ks)
    for te in (plain, ahead):
        te.cache.allocate("scratch")
        te.cache.prepare(["scratch"], [3])
        te.cache.release("scratch")
    same(plain, ahead, drafts(plain, rng, ids, ks))
    assert ahead.laid_ahead == [0, 1]
