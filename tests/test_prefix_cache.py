"""Prefix caching in process (models/prefix_cache.py in the target's and the draft's paged caches).

The pool: hits are whole full blocks of the same tokens under the same salt, shared by reference,
evicted least-recently-released first, never rolled back into. The engines: a workload of requests
sharing prefixes (several waves, cancellations between, a cache small enough to evict) gives the same
tokens with prefix caching on as off, greedy and seeded sampling, K = 0..4, with the same acceptance;
a draft whose cache lost a prefix the target still holds answers not_held and is re-synced; when idle
every reference is gone and every block is free or cached."""
import pytest
import torch

from models.kv_cache import PagedKVCache
from models.runner import new_cache
from services.draft.engine import DraftEngine, ProposeItem
from services.sampling import Sampling
from services.target.engine import TargetEngine
from test_engines import make_models

BS = 4


def pool_cache(blocks=8, shift=0):
    c = PagedKVCache(1, blocks, BS, 4, 2)
    c.enable_prefix_cache("m", shift)
    return c


def test_full_blocks_are_shared_by_reference_and_evicted_lru():
    c = pool_cache()
    a = list(range(10))                                  # 2 full blocks + 2 positions
    assert c.lookup(a, 9).positions == 0
    c.allocate("a")
    c.extend("a", 10)
    c.seal("a", a, 10)
    with pytest.raises(ValueError, match="sealed"):
        c.rollback("a", 3)                               # would drop into the sealed block 1
    c.rollback("a", 2)
    hit = c.lookup(a[:9] + [99], 9)                      # same first 8 tokens: both full blocks
    assert hit.positions == 8 and hit.blocks == c._tables["a"][:2]
    c.allocate("b", hit)
    assert [c.pool.refs[b] for b in hit.blocks] == [2, 2]
    part = c.lookup([0, 1, 2, 3, 7, 7, 7, 7, 7], 8)     # diverges in block 1
    assert part.positions == 4 and c.pool.refs[part.blocks[0]] == 3
    c.drop(part)
    c.release("a")
    c.release("b")
    c.pool.check_idle()
    assert c.num_free_blocks == 8 and c.pool.num_cached == 2
    c.allocate("big")
    c.extend("big", 8 * BS - 4)                          # 7 blocks: 6 free + the LRU one of the two cached
    hit = c.lookup(a, 9)
    assert c.pool.evictions == 1 and hit.positions == 4  # a table is released tail first: block 1 went first
    c.drop(hit)
    c.release("big")
    c.pool.check_idle()
    other = PagedKVCache(1, 8, BS, 4, 2)
    other.enable_prefix_cache("another model")           # the salt separates what else decides the values
    other.allocate("a")
    other.extend("a", 8)
    other.seal("a", a, 8)
    assert set(c.pool._block_of).isdisjoint(other.pool._block_of)


def test_the_draft_names_a_block_by_one_token_more():
    c = pool_cache(shift=1)
    toks = list(range(9))
    c.allocate("a")
    c.extend("a", 8)
    c.seal("a", toks, 8)                                 # block 1 needs token 8: known
    assert c.pool.num_cached == 2
    hit = c.lookup(toks[:8] + [5], 8)                    # token 8 differs: block 1 is another block
    assert hit.positions == 4
    c.drop(hit)
    c.release("a")
    c.pool.check_idle()


# --- engines ----------------------------------------------------------------------------------------
def make_engines(models, prefix: bool, blocks: int, draft_blocks: int | None = None):
    target, draft = models
    te = TargetEngine(target, new_cache(target, blocks, BS), 512)
    de = DraftEngine(draft, new_cache(draft, draft_blocks or blocks, BS), 512)
    if prefix:
        te.cache.enable_prefix_cache("target", 0)
        de.cache.enable_prefix_cache("draft", 1)
    return te, de


def prefill(te, de, prompts: dict, samp: dict, budget: int):
    """Prefill, whole (budget 0) or in chunks of `budget` positions, each chunk's rows given to the draft
    at once (Propose with no drafts: MTP position i pairs token i + 1 with row i) -> per request the first
    token, and what the first round's Propose sends: tokens, their position, the rows, cached_tokens."""
    first, todo, at = {}, list(prompts), {r: 0 for r in prompts}      # at: tokens given to the draft
    pending, rows, cached = {}, {}, {}
    while todo:
        res = te.prefill([(r, prompts[r], samp[r]) for r in todo], None, [budget] * len(todo))
        got = dict(zip(todo, res.hidden.split([e - s for s, e in zip(res.cached, res.computed)])))
        feed = []
        for r, s, e, tok in zip(todo, res.cached, res.computed, res.first):
            rows[r], cached[r] = got[r], (s if at[r] == 0 else 0)
            pending[r] = prompts[r][at[r]:e + 1] + ([tok] if e == len(prompts[r]) else [])
            if e == len(prompts[r]):
                first[r] = tok
            else:
                feed.append(ProposeItem(r, pending[r], 0, samp[r], at[r], cached[r]))
        if feed:
            assert de.expected_rows(feed) == {it.request_id: rows[it.request_id].shape[0] for it in feed}
            de.propose(feed, {it.request_id: rows[it.request_id] for it in feed})
            for it in feed:
                at[it.request_id] += len(it.new_token_ids)
        todo = [r for r in todo if r not in first]
    return first, pending, {r: at[r] for r in prompts}, rows, cached


def serve(te, de, prompts: dict, k: int, n: int, sampled: bool, cancel: set = frozenset(), budget: int = 0):
    """The gateway's loop in miniature, with prefix hits: Prefill, then Propose -> Verify; a request the
    draft did not take (not_held) is proposed again with every row (gateway/prefix_recovery.py). -> (tokens, accepted) per request."""
    samp = {r: Sampling(temperature=0.8, seed=i) if sampled else Sampling() for i, r in enumerate(prompts)}
    first, pending, position, rows, cached = prefill(te, de, prompts, samp, budget)
    out = {r: [first[r]] for r in prompts}
    acc = {r: 0 for r in prompts}
    live = list(prompts)
    while live:
        items = [ProposeItem(r, pending[r], k, samp[r], position[r], cached[r]) for r in live]
        assert de.expected_rows(items) == {r: rows[r].shape[0] for r in live}
        proposals = de.propose(items, {r: rows[r] for r in live})
        for b, r in enumerate(live):
            if r in de.not_held:                         # gateway/prefix_recovery.py: every row, same round
                pending[r], position[r] = list(prompts[r]) + out[r], 0
                (proposals[b],) = de.propose([ProposeItem(r, pending[r], k, samp[r])],
                                             {r: te.recompute_rows([(r, pending[r])])})
                assert r not in de.not_held
            position[r] += len(pending[r])
            cached[r] = 0
        accepted, emitted, hidden, *_ = te.verify([(r, d, q) for r, (d, q) in zip(live, proposals)])
        rows.update(zip(live, hidden.split([a + 1 for a in accepted])))
        for r, toks, a in zip(live, emitted, accepted):
            out[r] += toks
            acc[r] += a
            pending[r] = toks
        done = [r for r in live if len(out[r]) >= n or (r in cancel and len(out[r]) >= 2)]
        te.release(done)
        de.release(done)
        live = [r for r in live if r not in done]
    return {r: o[:n] for r, o in out.items()}, acc


def workload(vocab=512, seed=0):
    """Waves of requests over three shared prefixes (one long, two short) with distinct tails."""
    g = torch.Generator().manual_seed(seed)
    pre = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in (21, 9, 14)]
    waves = []
    for w in range(3):
        wave = {}
        for i in range(3):
            tail = torch.randint(3, vocab, (1 + (w + i) % 5,), generator=g).tolist()
            wave[f"w{w}r{i}"] = pre[(w + i) % 3] + (pre[0][:5] if i == 2 else []) + tail
        waves.append(wave)
    waves.append({"again": list(pre[0]) + [7]})          # the long prefix once more after the evictions
    return waves


def run_all(models, prefix: bool, k: int, sampled: bool, blocks: int, draft_blocks: int | None = None,
            budget: int = 0):
    te, de = make_engines(models, prefix, blocks, draft_blocks)
    tokens, acc = {}, {}
    for i, wave in enumerate(workload()):
        t, a = serve(te, de, wave, k, 6, sampled, cancel={f"w{i}r1"}, budget=budget)
        tokens.update(t)
        acc.update(a)
    assert not te.requests and not de.committed
    te.cache.pool.check_idle()
    de.cache.pool.check_idle()
    return tokens, acc, te, de


@pytest.fixture(scope="module")
def models():
    return make_models(head_std=0.5)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_prefix_caching_on_equals_off(models, k, sampled):
    off, acc_off, _, _ = run_all(models, False, k, sampled, blocks=22)
    on, acc_on, te, de = run_all(models, True, k, sampled, blocks=22)
    assert on == off
    assert acc_on == acc_off                             # the draft proposes from the first round after a hit
    assert te.cache.pool.hits > 0 and te.cache.pool.evictions > 0
    assert k == 0 or de.cache.pool.hits >= te.cache.pool.hits


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_draft_that_lost_the_prefix_is_recovered_in_the_round(models, sampled):
    """The draft's cache evicted a prefix the target still holds: not_held, every row recomputed and
    proposed again in the same round: the tokens and the acceptance of a run without prefix caching."""
    prompt = list(range(40, 80))
    outs = []
    for prefix in (False, True):
        te, de = make_engines(models, prefix, 40)
        serve(te, de, {"a": prompt + [5]}, 3, 6, sampled)
        de.cache.allocate("filler")                      # takes every free and cached block of the draft
        de.cache.extend("filler", de.cache.num_free_blocks * BS)
        de.cache.release("filler")
        outs.append(serve(te, de, {"b": prompt + [6]}, 3, 8, sampled))
    assert outs[0] == outs[1]
    assert te.cache.pool.hits == 40 and de.cache.pool.hits == 0 and de.cache.pool.evictions > 0


def test_scored_prompts_skip_the_cache(models):
    te, _ = make_engines(models, True, 40)
    p = list(range(3, 30))
    te.prefill([("a", p, Sampling())])
    res = te.prefill([("b", p, Sampling())], [(None, True)])
    assert res.cached == [0] and len(res.logprobs[0]["prompt"]) == len(p) - 1
    res = te.prefill([("c", p, Sampling())])
    assert res.cached == [24] and res.hidden.shape[0] == len(p) - 24


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_chunked_prefill_equals_whole(models, k, sampled):
    """Chunks of 5 positions (not a block multiple), the draft filled chunk by chunk; with prefix caching
    on (hits mid-prompt, evictions) and off: the tokens and the acceptance of a whole prefill."""
    whole, acc, _, _ = run_all(models, True, k, sampled, blocks=22)
    for prefix in (True, False):
        chunked, acc_c, te, _ = run_all(models, prefix, k, sampled, blocks=22, budget=5)
        assert chunked == whole and acc_c == acc
        assert not te.partial


def test_chunks_are_refused_when_they_disagree(models):
    from infra.errors import ServiceError
    te, _ = make_engines(models, True, 40)
    p = list(range(3, 30))
    res = te.prefill([("a", p, Sampling())], None, [10])
    assert (res.first, res.cached, res.computed, res.hidden.shape[0]) == ([0], [0], [10], 10)
    with pytest.raises(ServiceError, match="later chunk of a prompt of 27 tokens has 26"):
        te.prefill([("a", p[:-1], Sampling())], None, [10])
    assert te.release(["a"]) == 1 and not te.partial
    te.cache.pool.check_idle()
