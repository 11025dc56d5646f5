"""The draft's chained steps in one pass (services/draft/chain.py) propose exactly what the step-by-step
loop proposes, leave the cache as the loop leaves it, and keep speculation lossless."""
import pytest
import torch

from services.draft.chain import DraftChain
from services.draft.engine import DraftEngine
from services.sampling import Sampling
from tests.test_engines import engines, make_models, speculate

PROMPTS = {"a": [5, 9, 33, 2, 7, 100, 3], "b": [8, 1, 64, 12], "c": list(range(40, 77)), "d": [3] * 19}


def recording(de: DraftEngine) -> list:
    """Wrap de.propose to record every round's drafts and the cache lengths after it."""
    log, inner = [], de.propose

    def propose(items, rows):
        out = inner(items, rows)
        log.append(([d for d, _ in out], {it.request_id: de.cache.length(it.request_id) for it in items}))
        return out
    de.propose = propose
    return log


@pytest.mark.parametrize("k", [1, 2, 4, {"a": 4, "b": 1, "c": 3, "d": 0}])
def test_chain_equals_loop(k):
    """Greedy: same drafts round by round, same cache lengths, same output (with real, partial acceptance)."""
    target, draft = make_models(head_std=0.5)
    runs = []
    for chained in (False, True):
        te, de = engines(target, draft)
        if chained:
            de.chain = DraftChain(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
        log = recording(de)
        out, _, _ = speculate(te, de, PROMPTS, k, 24)
        runs.append((out, log, de))
    (out0, log0, _), (out1, log1, de1) = runs
    assert out1 == out0
    assert log1 == log0
    assert sum(len(d) for drafts, _ in log1 for d in drafts) > 0
    assert de1.chain.runs == len(log1)                   # every round drafted through the chain
    de1.release(list(PROMPTS))
    reserved = 1                                          # the chain's scratch block
    assert de1.cache.num_free_blocks == de1.cache.num_blocks - reserved


def test_chain_matches_greedy_decoding():
    """Lossless: speculative output through the chain equals the target's greedy decoding (K = 0)."""
    target, draft = make_models(head_std=0.5)
    te, de = engines(target, draft)
    plain, _, _ = speculate(te, de, PROMPTS, 0, 20)
    te, de = engines(target, draft)
    de.chain = DraftChain(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
    fast, _, _ = speculate(te, de, PROMPTS, 3, 20)
    assert fast == plain and de.chain.runs > 0


def test_sampled_round_keeps_the_loop():
    """A sampled request's drafts come from its own generator: the chain declines, the loop runs."""
    target, draft = make_models(head_std=0.5)
    te, de = engines(target, draft)
    de.chain = DraftChain(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
    sampling = {r: Sampling(temperature=1.0, seed=7) for r in PROMPTS}
    out, _, _ = speculate(te, de, PROMPTS, 2, 8, sampling=sampling)
    assert all(len(o) == 8 for o in out.values()) and de.chain.runs == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_chain_graph_equals_loop_on_gpu():
    """The captured chain (one replay for steps 2..k) against the eager loop, on the GPU."""
    from models import cuda_graphs
    torch.manual_seed(0)
    target, draft = make_models(head_std=0.5)
    target, draft = target.cuda(), draft.cuda()
    outs = []
    for chained in (False, True):
        te, de = engines(target, draft)
        cuda_graphs.enable(te)
        cuda_graphs.enable(de, extra_rows=1)
        if chained:
            de.graphs_enabled()
        log = recording(de)
        outs.append((speculate(te, de, PROMPTS, 3, 24)[0], log))
        if chained:
            assert de.chain.replays > 0
    assert outs[1] == outs[0]
