"""The draft's chained steps in one pass (services/draft/chain.py) propose exactly what the step-by-step
loop proposes, leave the cache as the loop leaves it, and keep speculation lossless."""
import pytest
import torch

from services.draft.chain import DraftChain
from services.draft.engine import DraftEngine
from infra.defaults import DRAFT_Q_MASS
from services.sampling import Sampling, TopQ
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


def test_a_chain_built_mid_serving_writes_only_its_scratch_slot_before_its_first_fill():
    """A chain variant is built on first use (a sampled round, a new batch bucket), its capture's warm-up running
    the body on the buffers before any fill: every slot they hold is the chain's scratch slot (a running request's
    cache slot there would be overwritten), every context 0."""
    target, draft = make_models()
    te, de = engines(target, draft)
    de.cache.allocate("running")
    de.cache.extend("running", 3 * de.cache.block_size)                       # it holds the first blocks
    chain = DraftChain(draft, de.cache, de.max_model_len, max_k=4, graphs=False)
    assert chain.scratch_slot >= 3 * de.cache.block_size
    for sampled in (False, True):
        st = chain._static(4, 3, sampled)
        assert st["slots"].tolist() == [[chain.scratch_slot] * 4] * 2 and not st["ctx"].any()
        chain._layout(st)                                  # as the body lays them out, before any fill
        assert st["slots"].tolist() == [[chain.scratch_slot] * 4] * 2 and not st["ctx"].any()


@pytest.mark.parametrize("k, q_mass, width", [(2, 1.0, 0), ({"a": 3, "b": 1, "c": 2, "d": 0}, 1.0, 0),
                                              (2, DRAFT_Q_MASS, 0), (3, 0.5, 0), (3, 0.9, 8)])
def test_sampled_chain_equals_loop(k, q_mass, width, monkeypatch):
    """Sampled (and mixed greedy / sampled) rounds: the chain draws the same tokens with the same q as the loop
    (keyed noise, kernels/noise.py), so the served output does not depend on which path ran; also with q cut to
    its top tokens (q_mass < 1: the same cut, the same sparse q sent) and, with a width of 8 tokens, rows too
    flat to cut going whole."""
    if width:
        for mod in ("services.draft.chain", "services.draft.engine"):
            monkeypatch.setattr(f"{mod}.DRAFT_Q_WIDTH", width)
    forms = set()
    target, draft = make_models(head_std=0.5)
    sampling = {"a": Sampling(temperature=1.0, seed=7), "b": Sampling(temperature=0.7, top_k=20, seed=3),
                "c": Sampling(), "d": Sampling(temperature=1.2, top_p=0.9, seed=11)}
    runs = []
    for chained in (False, True):
        te, de = engines(target, draft)
        de.q_mass = q_mass
        if chained:
            de.chain = DraftChain(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
        qs, inner = [], de.propose

        def propose(items, rows, inner=inner, qs=qs):
            out = inner(items, rows)
            assert all(q is None or isinstance(q, TopQ) <= (q_mass < 1) for _, q in out)
            forms.update(type(q).__name__ for _, q in out if q is not None)
            qs.append([q for _, q in out])
            return out
        de.propose = propose
        log = recording(de)
        out, _, _ = speculate(te, de, PROMPTS, k, 16, sampling=sampling)
        runs.append((out, log, qs, de))
    (out0, log0, q0, _), (out1, log1, q1, de1) = runs
    assert out1 == out0 and log1 == log0 and de1.chain.runs == len(log1)
    assert forms == ({"Tensor"} if q_mass >= 1 else {"TopQ", "Tensor"} if width else {"TopQ"}), forms
    for a, b in zip(q0, q1):
        for x, y in zip(a, b):
            assert (x is None) == (y is None)
            if isinstance(x, TopQ):
                assert torch.equal(x.ids, y.ids) and torch.allclose(x.probs, y.probs, atol=1e-6)
            elif x is not None:
                assert torch.allclose(x, y, atol=1e-6)


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


def test_top_mass_keeps_the_fewest_tokens_of_the_mass():
    """kernels/noise.py top_mass: the most probable tokens until their mass reaches the bound (at least one, at
    most `width`), renormalized, ids by falling probability, zeros past the kept ones."""
    from kernels.noise import top_mass
    q = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    cut, ids, probs, whole = top_mass(q, 0.75, width=3)
    assert ids[0, :2].tolist() == [1, 3] and ids[1, 0] == 2 and ids.shape == (3, 3)
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0]))      # 0.5 + 0.3 reach 0.75: two kept
    assert torch.allclose(probs[1], torch.tensor([1.0, 0.0, 0.0]))
    assert whole.tolist() == [False, False, True] and torch.equal(cut[2], q[2])   # 3 tokens hold 0.75: left whole
    assert torch.allclose(cut.sum(1), torch.ones(3)) and cut[0, 0] == 0 and cut[0, 2] == 0
    assert torch.allclose(cut[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    _, _, p, whole = top_mass(q, 0.81, width=4)
    assert int((p[0] > 0).sum()) == 3 and int((p[1] > 0).sum()) == 1 and not whole.any()   # w = V: never whole
    kept = TopQ.kept(ids, probs)                     # the wire form: as wide as the widest row
    assert kept.ids.shape == (3, 3) and TopQ.kept(ids[:2], probs[:2]).ids.shape == (2, 2)
    assert torch.allclose(TopQ.kept(ids[:2], probs[:2]).dense(4, "cpu"), cut[:2])


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
