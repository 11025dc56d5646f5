"""DeepSeek sparse attention's Triton kernels (kernels/triton_dsa.py) against their PyTorch references
(kernels/dsa.py): the indexer's scores (exact fp32 / bf16 and deployed fp8 modes), the top-k they select,
and sparse MLA over the selected keys (also against dense MLA when every causal key is selected).

Same two backends as tests/test_model_kernels.py: `interp` runs the kernels on CPU tensors under
TRITON_INTERPRET=1 (set here before triton is imported, on machines without CUDA), `cuda` compiles them
(skipped without CUDA). They agree to rounding, not bit for bit (other summation orders, fp32 scores
where the reference rounds them to bf16): fp32 within 1e-5, bf16 within 2 % of the output's scale.
"""

import pytest
import torch

from kernel_backends import BACKENDS, CUDA, INTERP, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401,F811

from kernels import dsa  # noqa: E402
from kernels.triton_dsa import index_scores_triton, sparse_mla_triton  # noqa: E402
from kernels.mla import latent_attention  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402
from triton_cubin import compile_for_gpu  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
INF = float("-inf")


# fp8 x fp8 dots: exact products in the interpreter; Hopper's fp8 tensor cores accumulate with fewer bits
# than fp32 (the DeepSeek-V3 report's reason to promote partial sums), seen here as ~1e-4 relative
FP8_TOL = {"cpu": 1e-5, "cuda": 5e-4}


def rel_scores(ours, ref) -> float:
    """rel() over the finite scores, after checking that the -inf pattern is the same."""
    assert torch.equal(ours.isneginf().cpu(), ref.isneginf().cpu())
    live = ~ref.isneginf()
    return rel(ours[live], ref[live]) if live.any() else 0.0


MIXED = [{"old": 23, "gone": 5}, {"dec": 9, "old": 1}, {"dec": 1, "old": 4, "new": 13}]   # decode, verify k+1, prefill


def grow(cache: PagedKVCache, steps):
    """Grow requests by `steps` (lists of {request: new tokens}); the last step's batch."""
    for step in steps:
        for r in step:
            if r not in cache:
                cache.allocate(r)
        batch = cache.prepare(list(step), list(step.values()))
    return batch


def kv_lens(batch) -> torch.Tensor:
    return torch.minimum(batch.positions + 1, batch.context_lens.long()[batch.token_request.long()])   # [N]


# --- indexer scores -----------------------------------------------------------------------------------------

def indexer_case(dev, H, D, block_size, seed=0):
    """fp32 q [N, H, D], w [N, H], an indexer key cache [blocks, block_size, D] with random contents, and
    the MIXED batch whose block tables address it."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 64, block_size, 16, 16, device=dev)        # the latent cache: block tables only
    batch = grow(cache, MIXED)
    N = batch.num_tokens
    q = torch.randn(N, H, D, generator=g).to(dev)
    w = torch.randn(N, H, generator=g).to(dev)
    k = torch.randn(cache.num_blocks, block_size, D, generator=g).to(dev)
    return batch, q, w, k


def width_of(batch) -> int:
    return int(batch.context_lens.max()) + 3                              # a few columns past every context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 16, 4), (8, 32, 16), (6, 24, 8)])    # H, D, block size
def test_index_scores_match_reference(dev, dtype, shape, launches):
    batch, q, w, k = indexer_case(dev, *shape)
    q, k = q.to(dtype), k.to(dtype)
    args = (q, w, k, None, batch.block_tables, batch.token_request, batch.positions, batch.context_lens,
            width_of(batch))
    out = index_scores_triton(*args, block_n=16)
    ref = dsa.index_scores(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel_scores(out, ref) <= TOL[dtype], rel_scores(out, ref)
    assert dev == "cuda" or launches["_index_kernel"] == 1


def test_index_scores_fp8_deployed(dev, launches):
    """Deployed mode: Hadamard-rotated q / k in fp8 e4m3 with power-of-two scales (q's folded into w, k's
    per key): equal to the reference on the same fp8 inputs, and close to the exact fp32 scores."""
    batch, q, w, k = indexer_case(dev, 8, 32, 4, seed=1)
    q8, q_scale = dsa.quantize_pow2(dsa.rotate(q))                        # [N, H, D], [N, H]
    k8, k_scale = dsa.quantize_pow2(dsa.rotate(k))                        # [blocks, bs, D], [blocks, bs]
    meta = (batch.block_tables, batch.token_request, batch.positions, batch.context_lens, width_of(batch))
    out = index_scores_triton(q8, w * q_scale, k8, k_scale, *meta, block_n=16)
    assert rel_scores(out, dsa.index_scores(q8, w * q_scale, k8, k_scale, *meta)) <= FP8_TOL[dev]
    assert rel_scores(out, dsa.index_scores(q, w, k, None, *meta)) <= 0.1   # fp8's rounding
    assert dev == "cuda" or launches["_index_kernel"] == 1


def test_index_scores_wide_table_padding_rows(dev, launches):
    """A graph's static layout: a block table and score width wider than any context (the extra columns
    -inf), rows pointing at a request of context 0 (all -inf), a static out buffer."""
    batch, q, w, k = indexer_case(dev, 4, 16, 4, seed=2)
    N, B, pad = batch.num_tokens, len(batch.query_lens), 3
    tables = torch.zeros(B + 1, 40, dtype=torch.int32, device=dev)
    tables[:B, : batch.block_tables.shape[1]] = batch.block_tables
    token_request = torch.cat([batch.token_request, torch.full((pad,), B, dtype=torch.int32, device=dev)])
    positions = torch.cat([batch.positions, torch.arange(pad, device=dev) * 7])          # any positions
    context_lens = torch.cat([batch.context_lens, torch.zeros(1, dtype=torch.int32, device=dev)])
    qq = torch.cat([q, torch.randn(pad, *q.shape[1:], device=dev)])
    ww = torch.cat([w, torch.randn(pad, w.shape[1], device=dev)])
    width = 40 * 4
    out = torch.full((N + pad, width), 7.0, device=dev)
    got = index_scores_triton(qq, ww, k, None, tables, token_request, positions, context_lens, width, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[N:], torch.full_like(out[N:], INF))
    ref = dsa.index_scores(q, w, k, None, batch.block_tables, batch.token_request, batch.positions,
                           batch.context_lens, width)
    assert rel_scores(out[:N], ref) <= 1e-5
    assert dev == "cuda" or launches["_index_kernel"] == 1


@pytest.mark.parametrize("topk", [5, 16])                                  # < and > some rows' kv_len
def test_topk_of_triton_scores_selects_reference_keys(dev, topk):
    batch, q, w, k = indexer_case(dev, 8, 32, 4, seed=3)
    args = (q, w, k, None, batch.block_tables, batch.token_request, batch.positions, batch.context_lens,
            width_of(batch))
    ours = dsa.topk_indices(index_scores_triton(*args, block_n=16), topk)
    ref = dsa.topk_indices(dsa.index_scores(*args), topk)
    assert torch.equal(ours.sort(-1).values, ref.sort(-1).values)                  # as sets per row
    assert torch.equal((ref >= 0).sum(-1), kv_lens(batch).clamp(max=topk).to(ref.device))


# --- sparse MLA ---------------------------------------------------------------------------------------------

def sparse_case(dev, dtype, h, R, P, block_size, k, seed=0):
    """A latent cache with random contents, the MIXED batch, queries, and indices [N, k]: per row a random
    subset of its causal positions, -1 between them; the first decode row selects nothing."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 64, block_size, R, P, dtype=dtype, device=dev)
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    batch = grow(cache, MIXED)
    N = batch.num_tokens
    q_lat = torch.randn(N, h, R, generator=g).to(dtype).to(dev)
    q_pe = torch.randn(N, h, P, generator=g).to(dtype).to(dev)
    indices = torch.full((N, k), -1, dtype=torch.int32)
    for n, kv in enumerate(kv_lens(batch).tolist()):
        pick = torch.randperm(kv, generator=g)[: torch.randint(1, k + 1, (), generator=g)]
        indices[n, torch.randperm(k, generator=g)[: len(pick)]] = pick.int()
    indices[0] = -1
    return cache, batch, q_lat, q_pe, indices.to(dev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 32, 16, 4), (3, 48, 8, 16), (20, 64, 16, 8)])   # h, R, P, block size
@pytest.mark.parametrize("splits", [None, 1, 3])                           # splits of the index list
def test_sparse_mla_matches_reference(dev, dtype, shape, splits, launches):
    cache, batch, q_lat, q_pe, indices = sparse_case(dev, dtype, *shape, k=24)
    args = (q_lat, q_pe, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request, indices, 0.17)
    out = sparse_mla_triton(*args, splits=splits, block_n=16)
    ref = dsa.sparse_mla(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) <= TOL[dtype], rel(out, ref)
    assert torch.equal(out[0], torch.zeros_like(out[0]))                  # no key selected: zeros
    assert dev == "cuda" or launches["_sparse_mla_kernel"] == 1 and launches["_combine_kernel"] == (splits == 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_over_all_causal_keys_is_dense_mla(dev, dtype, launches):
    """indices = every causal position (in shuffled order, -1 padded): dense MLA's output, into a static
    out buffer."""
    cache, batch, q_lat, q_pe, _ = sparse_case(dev, dtype, 4, 32, 16, 4, k=1)
    N, width = batch.num_tokens, int(batch.context_lens.max())
    g = torch.Generator().manual_seed(4)
    j = torch.arange(width)[torch.randperm(width, generator=g)].to(dev)
    indices = torch.where(j[None, :] < kv_lens(batch)[:, None], j[None, :], -1).int()
    out = torch.full_like(q_lat, 7.0)
    got = sparse_mla_triton(q_lat, q_pe, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request,
                            indices, 0.2, out=out, splits=2, block_n=16)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], 0.2)) <= TOL[dtype]
    assert dev == "cuda" or launches["_sparse_mla_kernel"] == 1 and N > 1


# --- CUDA only: DeepSeek shapes, captured in a graph ---------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
def test_dsa_deepseek_shapes_replay_in_cuda_graph():
    """H = 64, D = 128 fp8 scores and h = 16, R = 512, P = 64 bf16 sparse MLA over k = 2048 indices,
    captured in a CUDA graph with static buffers: the references' results on replay."""
    cache = PagedKVCache(1, 512, 64, 512, 64, dtype=torch.bfloat16, device="cuda")
    cache.ckv.normal_()
    cache.kpe.normal_()
    batch = grow(cache, [{"a": 3000, "b": 700}, {"a": 1, "b": 4}])
    N, width, g = batch.num_tokens, 4096, torch.Generator(device="cuda").manual_seed(0)
    q8, qs = dsa.quantize_pow2(torch.randn(N, 64, 128, device="cuda", generator=g))
    k8, ks = dsa.quantize_pow2(torch.randn(cache.num_blocks, 64, 128, device="cuda", generator=g))
    w = torch.rand(N, 64, device="cuda", generator=g) * qs
    ql = torch.randn(N, 16, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    qp = torch.randn(N, 16, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.zeros(2, width // 64, dtype=torch.int32, device="cuda")
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    meta = (tables, batch.token_request, batch.positions, batch.context_lens)
    scores = torch.empty(N, width, device="cuda")
    out = torch.empty_like(ql)

    def step():
        index_scores_triton(q8, w, k8, ks, *meta, width, out=scores)
        sparse_mla_triton(ql, qp, cache.ckv[0], cache.kpe[0], tables, batch.token_request,
                          dsa.topk_indices(scores, 2048), 0.1, out=out)
    step()                                                                 # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    scores.zero_()
    out.zero_()
    graph.replay()
    assert rel_scores(scores, dsa.index_scores(q8, w, k8, ks, *meta, width)) <= FP8_TOL["cuda"]
    ref = dsa.sparse_mla(ql.float(), qp.float(), cache.ckv[0].float(), cache.kpe[0].float(), tables,
                         batch.token_request, dsa.topk_indices(scores, 2048), 0.1)
    assert rel(out, ref) <= 2e-2


# --- compiled for sm_90 without a GPU -----------------------------------------------------------------------

COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_dsa as td
IDX = dict(req_ptr="*i32", pos_ptr="*i64", clen_ptr="*i32", bt_ptr="*i32", w_ptr="*fp32", ks_ptr="*fp32",
           out_ptr="*fp32")
IDX_C = dict(BLOCK_H=64, BLOCK_N=64, BLOCK_D=128, PRECISION="tf32")
MLA = dict(BLOCK_H=32, BLOCK_N=64, BLOCK_R=512, BLOCK_P=64, SPLITS=4, PER_SPLIT=8, DYNAMIC_LOOP=True,
           PRECISION="tf32")
KERNELS = [(td._index_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", **IDX), {**IDX_C, "HAS_SCALE": False}),
           (td._index_kernel, dict(q_ptr="*fp8e4nv", k_ptr="*fp8e4nv", **IDX), {**IDX_C, "HAS_SCALE": True}),
           (td._sparse_mla_kernel, dict(dict.fromkeys(["ql_ptr", "qp_ptr", "ckv_ptr", "kpe_ptr", "out_ptr"], "*bf16"),
            req_ptr="*i32", idx_ptr="*i32", bt_ptr="*i32", ws_ptr="*fp32", ml_ptr="*fp32"), MLA)]
for fn, ptrs, consts in KERNELS:
    sig = {a: "constexpr" if a in consts else ptrs[a] if a.endswith("_ptr") else
           "fp32" if a == "scale_log2" else "i64" if a.startswith("s_") else "i32" for a in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32), options=dict(num_warps=4, num_stages=2))
    assert k.asm["cubin"], fn.__name__
    print("compiled", fn.__name__)
'''


@pytest.mark.parametrize("arch", [90])                                      # H200: sm_90
def test_dsa_kernels_compile_for_the_gpu_without_one(tmp_path, arch):
    compile_for_gpu(COMPILE, arch, tmp_path, expected=3)
