"""The acceptance and sampling math (kernels/speculative.py) against first principles."""
import torch

from kernels.speculative import greedy_verify, rejection_sample, sampling_probs


def test_greedy_verify_prefix_and_bonus():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 2, 3], [9, 9, 9]])
    k = torch.tensor([3, 3, 3, 1])                    # last request drafted one token only
    accepted, emitted = greedy_verify(target, drafts, k)
    assert accepted.tolist() == [3, 1, 0, 1]
    assert emitted.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [1, -1, -1, -1], [9, 9, -1, -1]]


def test_sampling_probs_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 4)
    probs = sampling_probs(logits, torch.tensor([0.0, 1.0, 1.0, 0.5]), torch.tensor([0, 2, 0, 0]),
                           torch.tensor([0.0, 0.0, 0.7, 0.0]))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]                      # greedy: one-hot argmax
    top2 = torch.tensor([3.0, 2.0]).softmax(0)
    assert torch.allclose(probs[1], torch.cat([top2, torch.zeros(2)]))    # top-k 2
    full = logits[0].softmax(0)                                           # top-p 0.7: 0.665 < 0.7 -> keep 2
    assert (probs[2] > 0).tolist() == [True, True, False, False] and full[0] < 0.7
    assert torch.allclose(probs[3], (logits[0] / 0.5).softmax(0))        # temperature
    assert torch.allclose(probs.sum(-1), torch.ones(4))



def test_sampling_probs_without_truncation_skips_the_sort_and_equals_the_full_path():
    """truncate=False (no row asks top-k or top-p: the target's common case) gives the distributions of the sorting
    path, greedy rows one-hot; and a noise draw from them follows them (kernels/noise.py)."""
    from kernels.noise import choose, draw_keys
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    t, off = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0]), torch.zeros(6)
    full = sampling_probs(logits, t, off.long(), off)
    fast = sampling_probs(logits, t, off.long(), off, truncate=False)
    assert torch.allclose(fast, full, atol=1e-6) and fast[0].max() == 1.0 and fast[4].max() == 1.0
    n = 20000
    keys = draw_keys(torch.full((n,), 7, dtype=torch.long), torch.arange(n))
    toks = choose(fast[1].expand(n, 50), keys)
    freq = torch.bincount(toks, minlength=50).double() / n
    assert (freq - fast[1].double()).abs().max() < 0.015, (freq - fast[1]).abs().max()


def _draw(p, q, n, seed):
    """n rounds of K = len(q) drafting from q and verifying against p; -> emitted [n, K+1]."""
    g = torch.Generator().manual_seed(seed)
    K, V = q.shape
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(K)], 1)
    u = torch.rand(n, K, generator=g)
    e = torch.empty(n, V).exponential_(generator=g)
    return rejection_sample(p.expand(n, K + 1, V), q.expand(n, K, V), drafts, torch.full((n,), K), u, e)


def test_rejection_sampling_is_lossless():
    # The first emitted token must follow p[0] whatever q is (the standard rejection rule), and so
    # must the second, conditioned on the first draft being accepted (positions are independent here).
    torch.manual_seed(0)
    V, n = 6, 60000
    p = torch.rand(3, V) ** 2
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(2, V) ** 2
    q = q / q.sum(-1, keepdim=True)
    accepted, emitted = _draw(p, q, n, seed=1)
    first = torch.bincount(emitted[:, 0], minlength=V).float() / n
    assert (first - p[0]).abs().sum() / 2 < 0.01                          # total variation
    mask = accepted >= 1
    second = torch.bincount(emitted[mask, 1], minlength=V).float() / mask.sum()
    assert (second - p[1]).abs().sum() / 2 < 0.015
    # acceptance rate of the first draft = sum_x min(p, q)
    assert abs(mask.float().mean() - torch.minimum(p[0], q[0]).sum()) < 0.01


def test_rejection_sampling_degenerate_cases():
    V = 5
    p = torch.zeros(2, V)
    p[:, 3] = 1.0
    q = torch.zeros(1, V)
    q[0, 3] = 1.0
    accepted, emitted = _draw(p, q, 50, seed=2)                          # identical one-hots: accept, bonus
    assert accepted.tolist() == [1] * 50 and emitted[:, :2].unique().tolist() == [3]
    q2 = torch.zeros(1, V)
    q2[0, 1] = 1.0                                                       # draft never right: recover p's token
    accepted, emitted = _draw(p, q2, 50, seed=3)
    assert accepted.tolist() == [0] * 50 and emitted[:, 0].unique().tolist() == [3]
    assert (emitted[:, 1] == -1).all()


def test_rejection_sampling_respects_num_drafts():
    V = 4
    p = torch.full((1, 3, V), 0.25)
    q = torch.full((1, 2, V), 0.25)
    drafts = torch.tensor([[1, 2]])
    accepted, emitted = rejection_sample(p, q, drafts, torch.tensor([0]), torch.zeros(1, 2), torch.ones(1, V))
    assert accepted.tolist() == [0] and emitted[0, 1:].tolist() == [-1, -1]


def test_take_spans_copies_the_committed_rows():
    """The committed rows of a Verify (services/target/engine.py): back-to-back spans as one slice, others gathered,
    always a copy (the step's output may be a CUDA graph's buffer that the next step rewrites)."""
    from kernels.rows import take_spans
    x = torch.arange(24.).view(12, 2)
    for spans in ([(0, 12)], [(0, 1), (1, 3), (3, 4)], [(0, 2), (4, 5), (8, 12)], [(5, 6)], []):
        got = take_spans(x, spans)
        want = torch.cat([x[s:e] for s, e in spans]) if spans else x[:0]
        assert torch.equal(got, want) and got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_host_uniforms_are_the_devices_bits():
    """kernels/noise.py host_uniform (numpy, for the synthetic acceptance's few draws a Verify) gives exactly the
    uniforms of uniform(draw_keys(...)) (torch), negative seeds and large draw indices included."""
    from kernels.noise import draw_keys, host_uniform, uniform
    seeds = [0, 1, -1, 2**62 + 12345, -(2**63), 987654321]
    draws = [0, 7, 3, 2**40, 1, 99]
    want = uniform(draw_keys(torch.tensor(seeds), torch.tensor(draws)), 5).numpy()
    got = host_uniform(seeds, draws, 5)
    assert got.dtype == want.dtype and (got == want).all()
    assert 0 < got.min() and got.max() < 1 and len({round(x, 12) for x in got.ravel()}) == got.size
