"""PagedKVCache: cached decode equals a full forward, rollback forgets exactly what it drops, released
blocks return to the pool, exhaustion is all-or-nothing, misuse fails with clear errors."""
from __future__ import annotations

import pytest
import torch

from conftest import prefill_then_decode, tiny_model, tokens
from models.batch import Stage
from models.kv_cache import CacheFullError, PagedKVCache, UnknownRequestError
from models.runner import forward_tokens, new_cache

BLOCK = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def ids(model):
    return tokens(40, model.cfg.vocab_size, seed=11)


def full_forward(model, ids):
    """Hidden states of one causal forward over the whole sequence, no cache. -> [T, D]"""
    with torch.inference_mode():
        return model(torch.tensor([ids]), None, None)[0]


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("prefill", [1, 10, 16, 40])
def test_cached_decode_equals_full_forward(model, ids, prefill):
    full = full_forward(model, ids)
    assert full.shape == (40, model.cfg.hidden_size) and full.abs().max() > 0.5
    cached = prefill_then_decode(model, ids, prefill, BLOCK)
    assert max_diff(cached, full) <= TOL


def test_chunked_prefill_equals_full_forward(model, ids):
    cache = new_cache(model, block_size=BLOCK)
    chunks = [ids[i:i + 7] for i in range(0, len(ids), 7)]
    hidden = torch.cat([forward_tokens(model, cache, {"r": c}) for c in chunks])
    assert max_diff(hidden, full_forward(model, ids)) <= TOL
    assert cache.length("r") == 40 and cache.num_used_blocks == 3


@pytest.mark.parametrize("drafted,rejected", [(6, 6), (6, 4), (3, 1)])
def test_rollback_then_reappend_equals_never_appended(model, ids, drafted, rejected):
    """Prefix of 14 (block boundary at 16), `drafted` wrong tokens appended, the last `rejected` of them
    rolled back, then different tokens appended: as if the rejected ones had never been there."""
    prefix, wrong, fresh = ids[:14], tokens(drafted, model.cfg.vocab_size, seed=99), ids[14:24]
    kept = wrong[: drafted - rejected]
    cache = new_cache(model, num_blocks=8, block_size=BLOCK)
    forward_tokens(model, cache, {"r": prefix})
    free_before = cache.num_free_blocks
    forward_tokens(model, cache, {"r": wrong})
    cache.rollback("r", rejected)
    assert cache.length("r") == 14 + len(kept)
    assert cache.num_free_blocks == free_before - (14 + len(kept) > BLOCK)   # blocks past the kept length freed
    # another request takes the freed block and writes over the stale slots meanwhile
    forward_tokens(model, cache, {"other": tokens(20, model.cfg.vocab_size, seed=5)})
    got = forward_tokens(model, cache, {"r": fresh})

    expect = full_forward(model, prefix + kept + fresh)[-len(fresh):]
    assert max_diff(got, expect) <= TOL
    never = new_cache(model, block_size=BLOCK)
    forward_tokens(model, never, {"r": prefix + kept})
    assert max_diff(got, forward_tokens(model, never, {"r": fresh})) <= TOL
    # and what was rolled back mattered: keeping it changes the result
    with_wrong = full_forward(model, prefix + wrong + fresh)[-len(fresh):]
    assert max_diff(got, with_wrong) > 1e-3


def test_rollback_to_zero_then_restart(model, ids):
    cache = new_cache(model, num_blocks=4, block_size=BLOCK)
    forward_tokens(model, cache, {"r": ids[:20]})
    cache.rollback("r", 20)
    assert cache.length("r") == 0 and cache.num_free_blocks == 4
    got = forward_tokens(model, cache, {"r": ids[20:]})
    assert max_diff(got, full_forward(model, ids[20:])) <= TOL


def test_release_returns_blocks_to_pool(model, ids):
    cache = new_cache(model, num_blocks=8, block_size=BLOCK)
    forward_tokens(model, cache, {"a": ids, "b": ids[:5]})
    assert cache.num_free_blocks == 8 - 3 - 1 and cache.num_used_blocks == 4
    cache.release("a")
    assert cache.num_free_blocks == 7 and "a" not in cache and cache.request_ids() == ["b"]
    cache.release("a")                                  # idempotent: never frees a block twice
    cache.release("b")
    assert cache.num_free_blocks == 8 and cache.num_used_blocks == 0
    # the whole pool serves a new request, and what it computes is not polluted by the old contents
    long = tokens(8 * BLOCK, model.cfg.vocab_size, seed=8)
    got = forward_tokens(model, cache, {"c": long})
    assert cache.num_free_blocks == 0
    assert max_diff(got, full_forward(model, long)) <= TOL


def test_pool_exhaustion_is_all_or_nothing(model, ids):
    cache = new_cache(model, num_blocks=4, block_size=BLOCK)
    forward_tokens(model, cache, {"a": ids})            # 40 tokens: 3 blocks, 1 free
    cache.allocate("b")
    with pytest.raises(CacheFullError, match=r"exhausted.*needs 3 more blocks of 16 tokens, 1 of 4 free"):
        cache.prepare(["a", "b"], [10, 20])             # a needs 1 more block, b needs 2
    assert (cache.length("a"), cache.length("b"), cache.num_free_blocks) == (40, 0, 1)
    with pytest.raises(CacheFullError, match=r"request 'b' needs 3 more blocks.*1 of 4 free"):
        cache.extend("b", 33)
    assert cache.length("b") == 0 and cache.num_free_blocks == 1
    with pytest.raises(CacheFullError):                 # through the runner, with a brand-new request
        forward_tokens(model, cache, {"a": [1], "c": tokens(40, model.cfg.vocab_size, seed=2)})
    assert cache.request_ids() == ["a", "b"] and cache.length("a") == 40 and cache.num_free_blocks == 1
    # nothing was corrupted: a's next token still matches the uncached forward
    more = tokens(9, model.cfg.vocab_size, seed=4)
    got = forward_tokens(model, cache, {"a": more})
    assert max_diff(got, full_forward(model, ids + more)[-9:]) <= TOL
    assert cache.num_free_blocks == 0


def test_misuse_raises_clear_errors():
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=BLOCK, kv_lora_rank=8, rope_dim=4)
    cache.allocate("r")
    cache.extend("r", 5)
    with pytest.raises(ValueError, match=r"cannot roll back 6 positions of request 'r' holding 5"):
        cache.rollback("r", 6)
    with pytest.raises(ValueError, match=r"cannot roll back -1"):
        cache.rollback("r", -1)
    assert cache.length("r") == 5 and cache.num_free_blocks == 3
    for call in (lambda: cache.length("ghost"), lambda: cache.extend("ghost", 1),
                 lambda: cache.rollback("ghost", 1), lambda: cache.prepare(["r", "ghost"], [1, 1])):
        with pytest.raises(UnknownRequestError, match=r"'ghost' has no KV cache"):
            call()
    assert cache.length("r") == 5                        # prepare checked every id before extending
    with pytest.raises(ValueError, match="already has a KV cache"):
        cache.allocate("r")
    with pytest.raises(ValueError, match="unique"):
        cache.prepare(["r", "r"], [1, 1])
    with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
        PagedKVCache(1, 0, BLOCK, 8, 4)


@pytest.mark.parametrize("lens", [[1], [3], [2, 3], [1, 1, 1], [5, 2, 7], [4, 4, 4, 4, 1], [13], [1, 0, 9]])
def test_step_layout_views_start_16_byte_aligned(lens):
    """Every device field of a step's layout starts 16-byte aligned whatever N and B (Triton compiles a kernel per
    pointer alignment: an eager step of another N mod 4 would otherwise compile a variant mid-run), and each holds
    what it did before."""
    cache = PagedKVCache(1, 32, 4, 8, 4)
    ids = [f"r{i}" for i in range(len(lens))]
    for r in ids:
        cache.allocate(r)
    cache.prepare(ids, [3] * len(ids))                                       # some history first
    batch = cache.prepare(ids, lens)
    fields = [batch.positions, batch.slot_mapping, batch.token_request, batch.context_lens, batch.query_start,
              batch.block_tables]
    assert all(f.data_ptr() % 16 == 0 for f in fields), [f.data_ptr() % 16 for f in fields]
    N = sum(lens)
    assert batch.positions.tolist() == [3 + j for n in lens for j in range(n)]
    assert batch.token_request.tolist() == [b for b, n in enumerate(lens) for _ in range(n)]
    assert batch.context_lens.tolist() == [3 + n for n in lens] and batch.query_start.tolist()[-1] == N
    tables = batch.host_block_tables
    assert torch.equal(batch.block_tables, tables) and tables.dtype == torch.int32
    width = max(len(cache._tables[r]) for r in ids)                          # each request's blocks, zeros after
    assert tables.tolist() == [cache._tables[r] + [0] * (width - len(cache._tables[r])) for r in ids]
    want = [int(tables[b, p // 4]) * 4 + p % 4 for b, n in enumerate(lens) for p in range(3, 3 + n)]
    assert batch.slot_mapping.tolist() == want


@pytest.mark.parametrize("steps", [[[3, 1], [1]], [[1, 1, 1, 1], [2, 5]], [[7], [4, 4, 4]],
                                   [[5, 0, 3, 1], [9, 2], [0, 4, 4, 4]]])   # (an empty query among them)
def test_step_laid_out_into_a_graph_stage(steps):
    """With `staging` (a CUDA graph bucket's buffers, models/cuda_graphs.py), a step is laid out into the stage:
    its real fields equal the plain layout's, the input ids ride in the same transfer, and the padding rows point
    at position 0, the scratch slot and the last padding request (context 0, query start N); a later, smaller step
    of the same bucket leaves nothing of the earlier one behind but table entries past the requests' contexts."""
    plain, staged = PagedKVCache(1, 64, 4, 8, 4), PagedKVCache(1, 64, 4, 8, 4)
    stage = Stage.new(16, 4, 8, scratch_slot=252, device="cpu")
    staged.staging = lambda B, N, width: stage if B <= 4 and N <= 16 and width <= 8 else None
    for c in (plain, staged):
        for r in "abcd":
            c.allocate(r)
    for step, lens in enumerate(steps):
        ids, N, B = list("abcd"[:len(lens)]), sum(lens), len(lens)
        toks = [100 * step + i for i in range(N)]
        want, got = plain.prepare(ids, lens), staged.prepare(ids, lens, toks)
        assert stage.holds(got) and not stage.holds(want) and want.input_ids is None
        assert got.input_ids.tolist() == toks
        for f in ("positions", "slot_mapping", "token_request", "context_lens", "query_start"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
        assert got.block_tables.tolist() == want.block_tables.tolist() == got.host_block_tables.tolist()
        full = stage.batch()                                                 # what the graph reads
        assert full.positions[N:].tolist() == [0] * (16 - N) and full.slot_mapping[N:].tolist() == [252] * (16 - N)
        assert full.token_request[N:].tolist() == [3] * (16 - N) and full.input_ids[N:].tolist() == [0] * (16 - N)
        assert full.context_lens[B:].tolist() == [0] * (4 - B) and full.query_start[B + 1:].tolist() == [N] * (4 - B)
        w = want.block_tables.shape[1]
        assert full.block_tables[:B, :w].tolist() == want.block_tables.tolist() and full.block_tables.shape == (4, 8)
    before = plain.length("a")
    with pytest.raises(ValueError, match="tokens: expected 2"):
        plain.prepare(["a"], [2], [1, 2, 3])
    assert plain.length("a") == before                                       # nothing extended
