"""Lossless greedy needs a row to get the same bits alone and among other rows (tests/test_lossless_rows.py holds
it for cuBLAS's GEMMs): here the Triton kernels. The split MLA kernels cut a row's keys (dense) or its index list
(sparse) into splits whose fp32 partial sums are merged, so the cut must come from the row's own length, never
from how many rows the launch has or how wide its block table is; the router's fp32 logits sum each row in one
order. Both backends: interpreted on CPU, compiled on CUDA."""
import pytest
import torch

from kernel_backends import BACKENDS, CUDA, INTERP, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401,F811

from kernels import dsa  # noqa: E402
from kernels.mla import latent_attention  # noqa: E402
from kernels.triton_dsa import sparse_mla_triton  # noqa: E402
from kernels.triton_router import logits as router_logits  # noqa: E402
from kernels.triton_mla import SPLIT_TILES_MIN, SPLITS_MAX, mla_attention_triton, num_splits  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402

H, R, P, BS, BN = 4, 32, 16, 16, 16       # heads, latent, rope dims, block size, key tile


def case(dev, lens: dict[str, int], new: dict[str, int]):
    """A random fp32 cache holding requests of `lens` tokens, then a step of `new` rows each (decode: 1,
    verify: k + 1): -> cache, the step's batch, q_lat [N, H, R], q_pe [N, H, P]."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 96, BS, R, P, dtype=torch.float32, device=dev)
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    for step in (lens, new):
        for rid in step:
            if rid not in cache:
                cache.allocate(rid)
        batch = cache.prepare(list(step), list(step.values()))
    N = batch.num_tokens
    return cache, batch, torch.randn(N, H, R, generator=g).to(dev), torch.randn(N, H, P, generator=g).to(dev)


def test_splits_follow_the_table_not_the_rows():
    assert num_splits(64, 64) == 1                                     # one tile: no split
    assert num_splits(4096, 64) == 16                                  # 64 tiles, 4 a split
    assert num_splits(163840, 64) == SPLITS_MAX
    assert SPLIT_TILES_MIN >= 2


def test_dense_row_alone_equals_the_row_among_others(dev, launches):
    """Request a's decode row (121 keys: 8 tiles) alone, then with b's verify rows (N = 5) and with a table
    twice as wide: the same bits. The old rule (splits from N and the table) cut a's keys 8 or 2 ways."""
    cache, batch, ql, qp = case(dev, {"a": 120, "b": 40}, {"a": 1, "b": 4})
    common = (cache.ckv[0], cache.kpe[0])
    full = mla_attention_triton(ql, qp, *common, batch.block_tables, batch.token_request, batch.positions,
                                batch.context_lens, 0.2, block_n=BN)
    alone = mla_attention_triton(ql[:1], qp[:1], *common, batch.block_tables[:1], batch.token_request[:1],
                                 batch.positions[:1], batch.context_lens[:1], 0.2, block_n=BN)
    wide = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables)], dim=1)
    widened = mla_attention_triton(ql, qp, *common, wide, batch.token_request, batch.positions,
                                   batch.context_lens, 0.2, block_n=BN)
    assert torch.equal(alone[0], full[0]) and torch.equal(widened, full)
    assert rel(full, latent_attention(ql, qp, batch, *common, 0.2)) <= 1e-5
    assert dev == "cuda" or launches["_combine_kernel"] == 3           # the splits were merged each time


def test_splits_merged_inside_the_attention_launch(dev, launches):
    """With counters (models/kv_cache.PagedKVCache.arrivals) the split of a (row, head block) that arrives last
    merges them: the same bits as the combine kernel, one launch instead of two, and every counter back at zero
    for the next launch; too few counters for the launch's rows: the combine kernel, as without. Rows of 8, 3 and
    one key tile (c: one split, written as it is)."""
    cache, batch, ql, qp = case(dev, {"a": 120, "b": 40, "c": 10}, {"a": 1, "b": 4, "c": 1})
    args = (ql, qp, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request, batch.positions,
            batch.context_lens, 0.2)
    two = mla_attention_triton(*args, block_n=BN)
    arrivals = torch.zeros(ql.shape[0], dtype=torch.int32, device=dev)           # one head block a row
    for scale in (2.0, 1.0):         # after other partial sums in the workspace: a merge too early would show
        one = mla_attention_triton(ql * scale, *args[1:], block_n=BN, arrivals=arrivals)
        assert (scale != 1.0 or torch.equal(one, two)) and not arrivals.any()
    assert dev == "cuda" or launches["_combine_kernel"] == 1
    assert torch.equal(mla_attention_triton(*args, block_n=BN, arrivals=arrivals[:-1]), two)
    assert dev == "cuda" or launches["_combine_kernel"] == 2


def test_bench_attention_times_both_merges_and_checks_their_bits(dev, tmp_path):
    """`tandem bench attention`: two launches and the merged launch over rows of one split (16 keys) and of two
    (200 keys), side by side; the merged output has the two-launch bits and leaves the counters at zero."""
    import json
    from tandem.bench_attention import main
    assert main(["--device", dev, "--heads", "2", "--rows", "4", "--keys", "16,200", "--table-keys", "256",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention.json").read_text())
    assert [(r["rows"], r["keys"]) for r in rows] == [(4, 16), (4, 200)]
    assert all(r["max_abs_difference"] == 0 and r["counters_zero"] and r["two_launches_us"] > 0 and r["merged_us"] > 0
               and r["floor_us"] > 0 for r in rows), rows
    assert "| merged / two |" in (tmp_path / "attention.md").read_text()


def test_sparse_row_alone_equals_the_row_among_others(dev, launches):
    """The same for the sparse kernel: a row of 200 picks (13 tiles) alone and among five rows."""
    cache, batch, ql, qp = case(dev, {"a": 300, "b": 240}, {"a": 1, "b": 4})
    g = torch.Generator().manual_seed(1)
    limits = [301, 241, 242, 243, 244]                                 # each row's causal keys
    idx = torch.stack([torch.randperm(n, generator=g)[:200] for n in limits]).int().to(dev)
    common = (cache.ckv[0], cache.kpe[0])
    full = sparse_mla_triton(ql, qp, *common, batch.block_tables, batch.token_request, idx, 0.2, block_n=BN)
    alone = sparse_mla_triton(ql[:1], qp[:1], *common, batch.block_tables[:1], batch.token_request[:1], idx[:1],
                              0.2, block_n=BN)
    assert torch.equal(alone[0], full[0])
    args = (ql, qp, *common, batch.block_tables, batch.token_request, idx, 0.2)
    assert rel(full, dsa.sparse_mla(*args)) <= 1e-5
    assert dev == "cuda" or launches["_combine_kernel"] == 2


@pytest.mark.parametrize("E,D", [(64, 2048), (8, 200)])                 # V2-Lite's router; a ragged one
def test_router_logits_row_alone_equals_the_row_among_others(dev, E, D, launches):
    if dev == "cpu" and E * D > 10_000:
        pytest.skip("V2-Lite's shape: compiled only (interpreted, 40 s); the ragged shape runs here")
    g = torch.Generator().manual_seed(D)
    w = (torch.randn(E, D, generator=g) * 0.02).bfloat16().to(dev)
    x = torch.randn(40, D, generator=g).bfloat16().to(dev)
    full = router_logits(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert full.dtype == torch.float32 and rel(full, ref) <= 1e-5
    for m in (1, 2, 15, 17, 33):
        assert torch.equal(router_logits(x[:m], w), full[:m]), m
        assert torch.equal(router_logits(x[m - 1:m], w)[0], full[m - 1]), m    # alone, first in its block
    assert dev == "cuda" or launches["_logits_kernel"] == 11
