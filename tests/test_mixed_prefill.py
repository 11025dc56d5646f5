"""A Prefill riding a Verify (VerifyRequest.prefill, TargetEngine.verify_and_prefill): one forward gives what the
two calls give apart (tokens, committed rows, prompt rows, logprobs), and a prefill the target refuses (bad items,
no room in the KV cache) leaves nothing of it behind while the Verify still runs. The scheduler's side (which
steps mix, faults of the round) is tested in test_chunked_prefill.py, test_overlap_rounds.py and test_preemption.py;
served through real processes in test_chunked_prefill_served.py."""
import pytest
import torch

from infra.errors import ServiceError
from services.sampling import Sampling
from services.target.engine import TargetEngine
from test_engines import engines, make_models


@pytest.fixture(scope="module")
def models():
    return make_models()


def prompt(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def running(te: TargetEngine, n: int = 3) -> list[tuple[str, list[int], None]]:
    """n requests prefilled and running -> a Verify's items (two drafts each: the pending token repeated)."""
    te.prefill([(f"run{i}", prompt(9 + 5 * i, i), Sampling()) for i in range(n)])
    return [(f"run{i}", [te.requests[f"run{i}"].pending_token] * 2, None) for i in range(n)]


NEW = [("new0", prompt(23, 10), Sampling()), ("new1", prompt(40, 11), Sampling(temperature=0.8, seed=5))]


@pytest.mark.parametrize("budgets", [None, [0, 16]])
def test_one_forward_gives_what_the_two_calls_give(models, budgets):
    """Apart: Prefill(new) then Verify(running); together: one verify_and_prefill. Same tokens (greedy and seeded),
    same accepted counts, the same rows (to fp32 rounding: the GEMMs see other shapes), the same logprobs, and the
    same state after (chunked: new1 stays prefilling at 16 of 40 positions)."""
    apart, together = engines(*models), engines(*models)
    items_a, items_t = running(apart[0]), running(together[0])
    want, lp = [(1, False), (None, True)], [2, None, 0]
    pre = apart[0].prefill(NEW, want, budgets)
    ver = apart[0].verify(items_a, lp)
    ver2, pre2 = together[0].verify_and_prefill(items_t, lp, NEW, want, budgets)
    assert isinstance(pre2, tuple) and pre2.first == pre.first and (pre2.cached, pre2.computed) == (pre.cached, pre.computed)
    assert ver2.accepted == ver.accepted and ver2.emitted == ver.emitted
    torch.testing.assert_close(ver2.rows, ver.rows, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pre2.hidden, pre.hidden, rtol=1e-4, atol=1e-4)
    assert pre2.hidden.shape[0] == sum(e - s for s, e in zip(pre.cached, pre.computed))
    for a, b in zip(ver.logprobs, ver2.logprobs):
        assert [x[1] for x in a] == [x[1] for x in b] and [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-4)
    assert [e["first"] is None for e in pre2.logprobs] == [e["first"] is None for e in pre.logprobs]
    assert len(pre2.logprobs[1]["prompt"]) == len(pre.logprobs[1]["prompt"])
    a, t = apart[0], together[0]
    assert t.partial == a.partial and sorted(t.requests) == sorted(a.requests)
    assert t.cache.num_free_blocks == a.cache.num_free_blocks
    for rid in a.requests:
        assert t.requests[rid].tokens == a.requests[rid].tokens


def test_a_refused_prefill_leaves_nothing_and_the_verify_runs(models):
    """A prompt with an id past the vocabulary: the prefill is refused (INVALID_ARGUMENT naming the field), nothing
    of it is held, and the Verify gives what it gives alone. A request already running may not be prefilled again
    (ALREADY_EXISTS): its cache is not touched."""
    alone, te = engines(*models), engines(*models)
    items_a, items = running(alone[0]), running(te[0])
    ver = alone[0].verify(items_a)
    free = te[0].cache.num_free_blocks
    bad = [("new0", prompt(12, 1) + [10 ** 6], Sampling())]
    ver2, err = te[0].verify_and_prefill(items, None, bad)
    assert isinstance(err, ServiceError) and err.code == "INVALID_ARGUMENT" and "prompt_token_ids" in str(err)
    assert ver2.accepted == ver.accepted and ver2.emitted == ver.emitted
    assert "new0" not in te[0].requests and "new0" not in te[0].partial and "new0" not in te[0].cache
    assert te[0].cache.num_free_blocks == alone[0].cache.num_free_blocks <= free
    held = te[0].cache.length("run0")
    items = [(rid, [], None) for rid, _, _ in items]
    _, err = te[0].verify_and_prefill(items, None, [("run0", prompt(5, 2), Sampling())])
    assert err.code == "ALREADY_EXISTS" and te[0].cache.length("run0") == held + 1


def test_a_prefill_without_room_is_refused_alone(models):
    """A pool too small for the new prompt beside the round: RESOURCE_EXHAUSTED (the KV-cache-full message the
    gateway holds admission back on), the prompt's blocks given back, the Verify run."""
    te, _ = engines(*models, blocks=8)
    items = running(te, 2)
    free = te.cache.num_free_blocks
    ver, err = te.verify_and_prefill(items, None, [("big", prompt(16 * free, 3), Sampling())])
    assert isinstance(err, ServiceError) and err.code == "RESOURCE_EXHAUSTED" and "KV cache" in str(err)
    assert "big" not in te.cache and "big" not in te.partial and len(ver.accepted) == 2
    assert te.cache.num_free_blocks >= free - 2


@pytest.mark.parametrize("riding", [False, True])
def test_a_prompt_begun_in_chunks_stays_begun_when_a_step_has_no_room(models, riding):
    """A chunked prompt's next chunk in a step the pool cannot hold (a large new prompt beside it), alone or riding a
    Verify: RESOURCE_EXHAUSTED changes nothing of the begun prompt (the gateway sends its chunk again: "chunks of
    prompts begun stay begun", gateway/preemption.py), the new one holds nothing; the chunk then goes on where it was
    and the prompt's first token equals a whole prefill's."""
    te, _ = engines(*models, blocks=12)
    items = running(te, 1)
    long = ("long", prompt(60, 7), Sampling())
    te.prefill([long], None, [16])
    free, begun = te.cache.num_free_blocks, dict(te.partial)
    big = ("big", prompt(16 * free - 8, 8), Sampling())
    if riding:
        _, err = te.verify_and_prefill(items, None, [long, big], None, [16, 0])
        assert isinstance(err, ServiceError) and err.code == "RESOURCE_EXHAUSTED"
    else:
        with pytest.raises(ServiceError, match="KV cache"):
            te.prefill([long, big], None, [16, 0])
    assert te.partial == begun and "big" not in te.cache and te.cache.length("long") == 16
    while "long" in te.partial:
        out = te.prefill([long], None, [16])
    whole, _ = engines(*models, blocks=12)
    assert out.first[0] == whole.prefill([long]).first[0]
