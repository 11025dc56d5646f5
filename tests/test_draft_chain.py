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


@pytest.mark.parametrize("k", [2, {"a": 3, "b": 1, "c": 2, "d": 0}])
def test_sampled_chain_equals_loop(k):
    """Sampled (and mixed greedy / sampled) rounds: the chain draws the same tokens with the same q as the loop
    (keyed noise, kernels/noise.py), so the served output does not depend on which path ran."""
    target, draft = make_models(head_std=0.5)
    sampling = {"a": Sampling(temperature=1.0, seed=7), "b": Sampling(temperature=0.7, top_k=20, seed=3),
                "c": Sampling(), "d": Sampling(temperature=1.2, top_p=0.9, seed=11)}
    runs = []
    for chained in (False, True):
        te, de = engines(target, draft)
        if chained:
            de.chain = DraftChain(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
        qs, inner = [], de.propose

        def propose(items, rows, inner=inner, qs=qs):
            out = inner(items, rows)
            qs.append([None if q is None else q.clone() for _, q in out])
            return out
        de.propose = propose
        log = recording(de)
        out, _, _ = speculate(te, de, PROMPTS, k, 16, sampling=sampling)
        runs.append((out, log, qs, de))
    (out0, log0, q0, _), (out1, log1, q1, de1) = runs
    assert out1 == out0 and log1 == log0 and de1.chain.runs == len(log1)
    for a, b in zip(q0, q1):
        for x, y in zip(a, b):
            assert (x is None) == (y is None) and (x is None or torch.allclose(x, y, atol=1e-6))


def test_keyed_noise_is_exp1_and_batch_independent():
    """The noise is a function of (key, token id) only, and each draw's tokens follow q."""
    from kernels.noise import choose, draw_keys, exp_noise
    keys = draw_keys(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]))
    e = exp_noise(keys, 4096)
    assert torch.equal(e[0], exp_noise(keys[:1], 4096)[0]) and not torch.equal(e[0], e[1])
    assert abs(float(e.mean()) - 1.0) < 0.03 and abs(float(e.var()) - 1.0) < 0.08 and bool((e > 0).all())
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    n = 20000
    toks = choose(q.expand(n, 4), draw_keys(torch.full((n,), 99), torch.arange(n)))
    freq = torch.bincount(toks, minlength=4).float() / n
    assert torch.allclose(freq, q[0], atol=0.015) and int(freq[3]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("sampled", [False, True])
def test_chain_graph_equals_loop_on_gpu(sampled):
    """The captured chain (one replay for steps 2..k) against the eager loop, on the GPU; the keyed noise is
    the same on the GPU as on the CPU."""
    from models import cuda_graphs
    from kernels.noise import draw_keys, exp_noise
    keys = draw_keys(torch.tensor([1, -5, 1 << 40]), torch.tensor([0, 3, 7]))
    assert torch.equal(exp_noise(keys, 1000), exp_noise(keys.cuda(), 1000).cpu())
    target, draft = make_models(head_std=0.5)
    target, draft = target.cuda(), draft.cuda()
    sampling = {r: Sampling(temperature=1.0, seed=i) if sampled and r != "c" else Sampling()
                for i, r in enumerate(PROMPTS)}
    outs = []
    for chained in (False, True):
        te, de = engines(target, draft)
        cuda_graphs.enable(te)
        cuda_graphs.enable(de, extra_rows=1)
        if chained:
            de.graphs_enabled()
        log = recording(de)
        outs.append((speculate(te, de, PROMPTS, 3, 24, sampling=sampling)[0], log))
        if chained:
            assert de.chain.replays > 0
    assert outs[1] == outs[0]


def test_two_stage_argmax_equals_argmax():
    """kernels.speculative.argmax_rows: the first maximal index of each row, ties included."""
    from kernels.speculative import argmax_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 102400, generator=g)
    x[1, 777] = x[1, 90001] = 50.0                   # a tie across chunks: the first wins
    x[2, 5] = x[2, 6] = 60.0                         # a tie inside a chunk
    x[3] = 0.0                                       # all equal: index 0
    assert torch.equal(argmax_rows(x), x.argmax(-1)) and int(argmax_rows(x)[1]) == 777
    assert torch.equal(argmax_rows(x[:, :1000]), x[:, :1000].argmax(-1))      # short rows: one stage
