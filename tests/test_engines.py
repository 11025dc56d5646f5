"""Target and draft engines in process: acceptance, rollback, draft alignment, lossless sampling."""
import math

import pytest
import torch

from models.config import ModelConfig
from models.loader import build
from models.model import DraftModel, TargetModel
from models.runner import greedy_generate, new_cache
from models.tiny import TINY_CONFIG, init_random_
from infra.errors import ServiceError
from services.draft.engine import DraftEngine, ProposeItem
from services.sampling import Sampling
from services.target.engine import TargetEngine
from services.target.verify_io import target_probs


def make_models(vocab=512, head_std=0.02, seed=0):
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "vocab_size": vocab})
    target = init_random_(build(TargetModel, cfg), seed)
    draft = init_random_(build(DraftModel, cfg), seed + 1)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        target.lm_head.weight.normal_(0, head_std, generator=torch.Generator().manual_seed(seed + 2))
        draft.lm_head.weight.copy_(target.lm_head.weight * 0.7)
    return target, draft


def engines(target, draft, blocks=512):
    return (TargetEngine(target, new_cache(target, blocks), 2048),
            DraftEngine(draft, new_cache(draft, blocks), 2048))


def speculate(te: TargetEngine, de: DraftEngine, prompts: dict, k, n: int, sampling=None):
    """The gateway's loop in miniature: prefill, then Propose -> Verify rounds until n tokens each.
    k: draft tokens per round, one int or a dict per request, or a PolicyK (chosen each round)."""
    sampling = sampling or {r: Sampling() for r in prompts}
    policy = k if isinstance(k, PolicyK) else None
    k = k if isinstance(k, dict) or policy else {r: k for r in prompts}
    first, hidden, *_ = te.prefill([(r, p, sampling[r]) for r, p in prompts.items()])
    rows = dict(zip(prompts, hidden.split([len(p) for p in prompts.values()])))
    out = {r: [t] for r, t in zip(prompts, first)}
    pending = {r: list(p) + [t] for (r, p), t in zip(prompts.items(), first)}
    position = {r: 0 for r in prompts}
    while any(len(o) < n for o in out.values()):
        live = [r for r in prompts if len(out[r]) < n]
        k = policy.plan(live) if policy else k
        items = [ProposeItem(r, pending[r], k[r], sampling[r], position[r]) for r in live]
        expected = de.expected_rows(items)
        assert all(expected[r] == rows[r].shape[0] for r in live), (expected, {r: rows[r].shape for r in live})
        proposals = de.propose(items, {r: rows[r] for r in live})
        for r in live:
            position[r] += len(pending[r])
        accepted, emitted, hidden, *_ = te.verify([(r, d, q) for r, (d, q) in zip(live, proposals)])
        if policy:
            policy.observe(live, [len(d) for d, _ in proposals], accepted)
        rows.update(zip(live, hidden.split([a + 1 for a in accepted])))
        for r, toks in zip(live, emitted):
            out[r] += toks
            pending[r] = toks
    return {r: o[:n] for r, o in out.items()}, te, de


class PolicyK:
    """k of each request and round chosen by the gateway's adaptive policy (gateway/adaptive.py), over
    GenRequest stand-ins of the prompts. Its round cost is given (`cost_per_draft`: a draft token costs
    that share of a request's verify step), so k follows each request's acceptance so far. The draft
    engine is fed every request each round (a parked one proposes 0 drafts: in process nothing is saved)."""

    def __init__(self, ids, cap: int, cost_per_draft: float):
        from gateway.adaptive import AdaptivePolicy
        from gateway.request import GenRequest
        from tandem.v1 import rows_pb2
        self.policy = AdaptivePolicy(cap)
        self.policy.started = {b: 1 << 30 for b in range(16)}               # no start-up schedule: costs are given
        self.policy.costs.round_s = lambda batch, m, rows0, steps: batch + cost_per_draft * m
        self.reqs = {r: GenRequest(id=r, prompt_ids=[1], max_tokens=1 << 20, k=cap, text=None,
                                   sampling=rows_pb2.SamplingParams(temperature=1.0)) for r in ids}
        self.chosen: list[dict] = []

    def plan(self, live) -> dict:
        batch = [self.reqs[r] for r in live]
        for g in batch:
            g.draft.speculate, g.draft.parked = True, False
        spec = {id(g) for g in self.policy.plan(batch)}
        self.chosen.append({g.id: g.round_k() if id(g) in spec else 0 for g in batch})
        return self.chosen[-1]

    def observe(self, live, ks, accepted) -> None:
        for r, kr, a in zip(live, ks, accepted):
            self.reqs[r].stats.add(kr, a)
        self.policy.observe([self.reqs[r] for r in live], {})


def test_oracle_drafts_accepted_and_rolled_back():
    target, _ = make_models()
    te = TargetEngine(target, new_cache(target, 64), 2048)
    prompt = [3, 17, 42, 9, 100, 7]
    ref = greedy_generate(target, prompt, 12)
    (first,), *_ = te.prefill([("a", prompt, Sampling())])
    assert first == ref[0]
    acc, out, rows, *_ = te.verify([("a", ref[1:4], None)])                 # all three drafts right
    assert acc == [3] and out == [ref[1:5]] and rows.shape[0] == 4
    acc, out, rows, *_ = te.verify([("a", [ref[5], ref[6], 1, 2], None)])   # wrong at position 2
    assert acc == [2] and out == [ref[5:8]] and rows.shape[0] == 3
    assert te.cache.length("a") == len(prompt) + 1 + 4 + 2               # rejected positions rolled back
    acc, out, *_ = te.verify([("a", [], None)])                          # k = 0: plain decoding
    assert acc == [0] and out == [[ref[8]]]
    te.release(["a"])
    assert te.cache.num_free_blocks == te.cache.num_blocks
    with pytest.raises(ServiceError) as e:
        te.verify([("a", [1], None)])
    assert e.value.code == "FAILED_PRECONDITION" and "'a'" in str(e.value)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_equals_target_and_draft_is_aligned(k):
    target, draft = make_models()
    prompts = {f"r{i}": [(7 * i + j) % 500 + 3 for j in range(3 + 5 * i)] for i in range(4)}
    out, te, de = speculate(*engines(target, draft), prompts, k, 10)
    for r, p in prompts.items():
        assert out[r] == greedy_generate(target, p, 10), r
    # the draft cache holds exactly the committed pairs (no speculative leftovers after rollback)
    for r in prompts:
        assert de.committed[r] <= de.cache.length(r) <= de.committed[r] + k - 1


def test_mtp_drafts_match_a_from_scratch_recomputation():
    """The incremental draft (rollback + append across rounds) proposes what a fresh MTP pass over the
    whole committed history proposes: the cache alignment is right."""
    target, draft = make_models()
    te, de = engines(target, draft)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    (t0,), hidden, *_ = te.prefill([("a", prompt, Sampling())])
    seq, rows, pending, pos = prompt + [t0], hidden, prompt + [t0], 0
    for _ in range(4):
        (drafts, _), = de.propose([ProposeItem("a", pending, 2, Sampling(), pos)], {"a": rows})
        pos += len(pending)
        # from scratch: target hidden over seq[:-1], MTP over pairs (h_i, seq[i+1]) in a fresh cache
        t2 = TargetEngine(target, new_cache(target, 64), 2048)
        _, h_all, *_ = t2.prefill([("x", seq[:-1], Sampling())])
        fresh = DraftEngine(draft, new_cache(draft, 64), 2048)
        (ref, _), = fresh.propose([ProposeItem("x", seq, 1, Sampling(), 0)], {"x": h_all})
        assert drafts[0] == ref[0]
        acc, (toks,), rows, *_ = te.verify([("a", drafts, None)])
        seq += toks
        pending = toks


def _chi2_crit(df: int, z: float = 3.09) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.inference_mode()
def _exact_next(target, prefixes: list[list[int]], sampling: Sampling) -> torch.Tensor:
    """Target-only distribution of the next token after each prefix -> [P, V]."""
    h = target.model(torch.tensor(prefixes, device=target.lm_head.weight.device), None, None)[:, -1]
    logits = target.compute_logits(h)
    n = len(prefixes)
    return target_probs(logits, [sampling] * n)


@pytest.mark.parametrize("top_k, adaptive", [(0, False), (4, False), (0, True), (4, True)])
def test_speculative_sampling_matches_target_distribution(top_k, adaptive):
    """Tokens 1-2 jointly and token 3 follow the target alone, with K = 2 or with the adaptive policy's k
    (0..2 a request and round, chosen from that request's acceptance so far)."""
    _sampling_law(top_k, adaptive, "cpu")


@pytest.mark.parametrize("device, q_mass, width", [("cpu", 0.5, 0), ("cpu", 0.8, 3), pytest.param(
    "cuda", 0.5, 0, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_speculative_sampling_matches_target_distribution_with_a_cut_draft(device, q_mass, width, monkeypatch):
    """The same law when the draft samples from its distribution cut to its top tokens of mass q_mass and sends
    only those (DraftEngine.q_mass, kernels/noise.py top_mass), or (width 3) leaves rows too flat to cut whole:
    output follows the target whatever q is."""
    if width:
        for mod in ("services.draft.chain", "services.draft.engine"):
            monkeypatch.setattr(f"{mod}.DRAFT_Q_WIDTH", width)
    _sampling_law(0, False, device, q_mass=q_mass)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_k", [0, 4])
def test_speculative_sampling_matches_target_distribution_on_cuda(top_k):
    """The same law on the GPU: the Triton acceptance kernel with the noise drawn on the device."""
    _sampling_law(top_k, False, "cuda")


def _sampling_law(top_k: int, adaptive: bool, device: str, q_mass: float | None = None) -> None:
    V, N = 16, 3000
    target, draft = (m.to(device) for m in make_models(vocab=V, head_std=0.6, seed=3))
    s = Sampling(temperature=1.0, top_k=top_k)
    prompt = [1, 2, 3, 4]
    prompts = {f"s{i}": prompt for i in range(N)}
    samp = {r: Sampling(1.0, 0.0, top_k, seed=i) for i, r in enumerate(prompts)}
    k = PolicyK(prompts, 2, cost_per_draft=0.08) if adaptive else 2
    te, de = engines(target, draft, blocks=N + 8)
    de.q_mass = de.q_mass if q_mass is None else q_mass
    out, te, _ = speculate(te, de, prompts, k, 4 if adaptive else 3, samp)
    if adaptive:                          # the policy's k differed between requests after their first round
        assert len(set(k.chosen[1].values())) >= 2, [sorted(set(ks.values())) for ks in k.chosen]
    toks = torch.tensor([out[r][:3] for r in prompts])                   # [N, 3]
    p1 = _exact_next(target, [prompt], s)[0].cpu()                       # [V]
    p2 = _exact_next(target, [prompt + [a] for a in range(V)], s).cpu()  # [V, V]
    joint = (p1[:, None] * p2).flatten()                                 # P(t1, t2)
    p3 = _exact_next(target, [prompt + [a, b] for a in range(V) for b in range(V)], s).cpu()
    marg3 = (joint[:, None] * p3).sum(0)                                 # P(t3)
    for observed, expected in ((toks[:, 0] * V + toks[:, 1], joint), (toks[:, 2], marg3)):
        counts = torch.bincount(observed, minlength=expected.numel()).double()
        e = expected.double() * N
        keep = e > 0
        assert counts[~keep].sum() == 0                                  # never a token outside top-k
        chi2 = ((counts[keep] - e[keep]) ** 2 / e[keep]).sum().item()
        assert chi2 < _chi2_crit(int(keep.sum()) - 1), (chi2, int(keep.sum()))


def test_seeded_sampling_ignores_batch_mates():
    """A seeded request samples the same tokens alone and beside requests that draft more tokens."""
    target, draft = make_models(vocab=64, head_std=0.6, seed=4)
    s = {"x": Sampling(1.0, seed=7), "y": Sampling(1.0, seed=8), "z": Sampling(0.0)}
    alone, _, _ = speculate(*engines(target, draft), {"x": [1, 2, 3]}, 1, 8, {"x": s["x"]})
    mixed = {"x": [1, 2, 3], "y": [4, 5, 6, 7], "z": [9, 8]}
    # x drafts 1 token per round, its batch-mates 3: the target's per-request draws must not shift
    together, _, _ = speculate(*engines(target, draft), mixed, {"x": 1, "y": 3, "z": 3}, 8, s)
    assert together["x"] == alone["x"]



def test_the_draft_holds_the_whole_context():
    """The draft caches a pair a token given but the last and a position a draft but the last: the longest
    prompt the target takes (max_model_len - 1) with its first token fills max_model_len - 1 positions and may
    draft two tokens (the gateway sends a finishing request's last tokens with the next round's Propose before it
    commits them, so a Propose may reach the end); three drafts need one more position: OUT_OF_RANGE naming it."""
    M = 24
    target, draft = make_models()
    te, de = TargetEngine(target, new_cache(target, 64), M), DraftEngine(draft, new_cache(draft, 64), M)
    prompt = [(5 * j) % 500 + 3 for j in range(M - 1)]
    (first,), hidden, *_ = te.prefill([("a", prompt, Sampling())])
    with pytest.raises(ServiceError) as e:
        de.expected_rows([ProposeItem("a", prompt + [first], 3, Sampling(), 0)])
    assert e.value.code == "OUT_OF_RANGE" and f"need {M + 1} cache positions" in str(e.value)
    item = ProposeItem("a", prompt + [first], 2, Sampling(), 0)
    assert de.expected_rows([item]) == {"a": M - 1} and hidden.shape[0] == M - 1
    [(drafts, _)] = de.propose([item], {"a": hidden})
    assert len(drafts) == 2 and de.cache.length("a") == M


def test_target_warms_its_acceptance_kernels_for_every_draft_count(monkeypatch):
    """With CUDA graphs on, the target runs greedy and sampled acceptance at start for 0 .. WARM_DRAFTS drafts
    (Triton compiles one kernel per draft count: the first k = 1 probe of the adaptive policy paid it inside a
    Verify); the engine decodes as before afterwards."""
    from services.target import engine as te_mod
    target, draft = make_models()
    te, _ = engines(target, draft)
    seen = {"greedy": [], "sampled": []}
    real_g, real_r = te_mod.greedy_accept, te_mod.rejection_sample
    monkeypatch.setattr(te_mod, "greedy_accept",
                        lambda x, i, d, n: seen["greedy"].append(d.shape[1]) or real_g(x, i, d, n))
    monkeypatch.setattr(te_mod, "rejection_sample",
                        lambda p, q, d, n, u, e: seen["sampled"].append(d.shape[1]) or real_r(p, q, d, n, u, e))
    te.graphs_enabled(1)
    assert seen == {"greedy": list(range(te_mod.WARM_DRAFTS + 1)), "sampled": list(range(1, te_mod.WARM_DRAFTS + 1))}
    te.prefill([("r", [1, 2, 3], Sampling())])
    assert te.verify([("r", [5, 6], None)]).accepted[0] in (0, 1, 2)


def test_eager_steps_past_the_graphs_are_run_at_start():
    """GraphedForward.warm_eager: one eager forward per size past the graphs' buckets, over scratch requests that are
    freed after (the pool as before, every other request untouched); a size the pool cannot hold is left out. (On
    the H200 a first eager step of a new size class compiled the fused MoE's kernels mid-serving: 0.3-7 s.)"""
    from models.cuda_graphs import GraphedForward
    target, _ = make_models()
    cache = new_cache(target, 96)
    calls = []

    def fn(tokens, batch, cache):
        calls.append((len(batch.query_lens), batch.num_tokens))
        return target(tokens, batch, cache)
    g = GraphedForward(fn, cache, target.cfg.hidden_size, torch.float32, 2048, max_tokens=64)
    cache.allocate("kept")
    cache.extend("kept", 20)
    free = cache.num_free_blocks
    assert g.warm_eager([(72, 1), (204, 3), (5000, 1)]) == 2       # 5000 tokens: more blocks than the pool has
    assert calls == [(1, 72), (3, 204)] and cache.num_free_blocks == free and cache.length("kept") == 20
