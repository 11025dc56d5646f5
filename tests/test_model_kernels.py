"""The model's Triton kernels against their PyTorch references: paged MLA attention (kernels/triton_mla.py
vs kernels/mla.py) and the fused MoE (kernels/triton_moe.py vs MoE's expert loop),
then a whole tiny model's greedy decoding on the Triton path, and (CUDA) a forward captured in a graph.

Same two backends as tests/test_triton_kernels.py: `interp` runs the kernels on CPU tensors under
TRITON_INTERPRET=1 (set here before triton is imported, on machines without CUDA), `cuda` compiles them
(skipped without CUDA). They agree to rounding, not bit for bit (other summation orders, fp32 scores
where the reference rounds them to bf16): fp32 within 1e-5, bf16 within 2 % of the output's scale.
"""
import dataclasses

import pytest
import torch

from kernel_backends import BACKENDS, CUDA, INTERP, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401,F811

from kernels import dispatch, flashinfer_mla  # noqa: E402
from kernels.triton_mla import mla_attention_triton  # noqa: E402
from kernels.triton_moe import fused_moe_triton, moe_align  # noqa: E402
from kernels.mla import latent_attention  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402
from models.loader import build  # noqa: E402
from models.model import TargetModel  # noqa: E402
from models.moe import MoE  # noqa: E402
from models.runner import forward_tokens, greedy_generate, new_cache  # noqa: E402
from models.tiny import TINY_CONFIG, init_random_  # noqa: E402
from triton_cubin import compile_for_gpu  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def tiny_model(seed: int):
    # conftest's helper, here so that this file runs with --noconftest (GPU machines without the API stack)
    return init_random_(build(TargetModel, ModelConfig.from_dict(TINY_CONFIG)), seed, 0.05)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- paged MLA attention ----------------------------------------------------------------------------------

def attention_case(dev, dtype, h, R, P, block_size, steps, seed=0):
    """A cache with random contents, requests grown by `steps` (lists of {request: new tokens}); returns
    the cache and the last step's batch (mixed prefill / decode / verify-like rows)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 64, block_size, R, P, dtype=dtype, device=dev)
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    for step in steps:
        for r in step:
            if r not in cache:
                cache.allocate(r)
        batch = cache.prepare(list(step), list(step.values()))
    N = batch.num_tokens
    q_lat = torch.randn(N, h, R, generator=g).to(dtype).to(dev)
    q_pe = torch.randn(N, h, P, generator=g).to(dtype).to(dev)
    return cache, batch, q_lat, q_pe


MIXED = [{"old": 23, "gone": 5}, {"dec": 9, "old": 1}, {"dec": 1, "old": 4, "new": 13}]   # decode, verify k+1, prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 32, 16, 4), (3, 48, 8, 16), (20, 64, 16, 8)])   # h, R, P, block size
@pytest.mark.parametrize("splits", [None, 1, 3])                           # key splits (decode's flash-decoding)
def test_mla_matches_reference(dev, dtype, shape, splits, launches):
    h, R, P, bs = shape
    cache, batch, q_lat, q_pe = attention_case(dev, dtype, h, R, P, bs, MIXED)
    scale = 0.17
    out = mla_attention_triton(q_lat, q_pe, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request,
                               batch.positions, batch.context_lens, scale, splits=splits, block_n=16)
    ref = latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) <= TOL[dtype], rel(out, ref)
    assert dev == "cuda" or launches["_mla_kernel"] == 1 and launches["_combine_kernel"] == (splits == 3)


def test_mla_padding_rows_write_zeros(dev, launches):
    """Graph padding: rows pointing at a request of context 0 output zeros, real rows are unchanged."""
    cache, batch, q_lat, q_pe = attention_case(dev, torch.float32, 4, 32, 16, 4, MIXED)
    N, B = batch.num_tokens, len(batch.query_lens)
    pad = 5
    token_request = torch.cat([batch.token_request, torch.full((pad,), B, dtype=torch.int32, device=dev)])
    positions = torch.cat([batch.positions, torch.arange(pad, device=dev) * 7])     # any positions
    context_lens = torch.cat([batch.context_lens, torch.zeros(1, dtype=torch.int32, device=dev)])
    tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:1])])
    ql = torch.cat([q_lat, torch.randn(pad, *q_lat.shape[1:], device=dev)])
    qp = torch.cat([q_pe, torch.randn(pad, *q_pe.shape[1:], device=dev)])
    ref = latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], 0.2)
    for splits in (1, 4):
        out = mla_attention_triton(ql, qp, cache.ckv[0], cache.kpe[0], tables, token_request, positions,
                                   context_lens, 0.2, splits=splits)
        assert torch.equal(out[N:], torch.zeros_like(out[N:]))
        assert rel(out[:N], ref) <= 1e-5


def test_mla_wide_static_block_table(dev, launches):
    """A table wider than needed (a graph's fixed width) and a static out buffer give the same result."""
    cache, batch, q_lat, q_pe = attention_case(dev, torch.float32, 4, 32, 16, 4, MIXED)
    wide = torch.zeros(len(batch.query_lens), 40, dtype=torch.int32, device=dev)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    out = torch.full_like(q_lat, 7.0)
    got = mla_attention_triton(q_lat, q_pe, cache.ckv[0], cache.kpe[0], wide, batch.token_request,
                               batch.positions, batch.context_lens, 0.2, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel(out, latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], 0.2)) <= 1e-5


# --- fused MoE ----------------------------------------------------------------------------------------------

def reference_moe(x, w13, w2, weights, ids, first):
    """Per pair, in fp32: sum_s w * down(silu(gate x) * up x) over this rank's experts."""
    I = w2.shape[-1]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s]) - first
            if 0 <= e < w13.shape[0]:
                gu = w13[e].float() @ x[t].float()
                y[t] += weights[t, s] * (w2[e].float() @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["uneven", "one_expert", "ep_shard", "block_m_64", "empty"])
def test_fused_moe_matches_reference(dev, dtype, case, launches):
    g = torch.Generator().manual_seed(1)
    N, D, I, E, k, first, block_m = 19, 96, 40, 8, 3, 0, None
    if case == "empty":
        N = 0
    x = torch.randn(N, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1
    probs = torch.tensor([8, 4, 2, 1, 1, 0, 0, 0.5])                        # uneven; experts 5, 6 get nothing
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(N)]) if N else torch.zeros(0, k).long()
    if case == "one_expert":
        ids[:, 0] = 2
    weights = torch.rand(N, k, generator=g)
    if case == "ep_shard":                                                  # this rank holds experts 2..5
        first, w13, w2 = 2, w13[2:6], w2[2:6]
    if case == "block_m_64":
        block_m = 64
    ref = reference_moe(x, w13, w2, weights, ids, first)
    cast = [t.to(dtype).to(dev) for t in (x, w13, w2)]
    out = fused_moe_triton(*cast, weights.to(dev), ids.to(dev), first, block_m)
    assert out.shape == (N, D) and out.dtype == dtype
    if N:
        assert rel(out, ref) <= TOL[dtype], rel(out, ref)
        assert dev == "cuda" or launches["_gate_up_kernel"] == 1 and launches["_down_kernel"] == 1
        assert dev == "cuda" or launches["_group_kernel"] == 1 and launches["_sum_pairs_kernel"] == 1


def test_moe_align_layout(dev):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [7, 3]], device=dev)        # expert 7: another rank's
    pairs, blocks = moe_align(ids, 0, 4, 2)
    assert blocks.shape == (4 + 4,) and pairs.shape == (16,)
    # experts 0: pairs 1, 4; 1: pair 3; 3: pairs 0, 2, 5, 7 -> blocks [0 | 1 | 3, 3] then unused
    # (the order inside an expert's rows is free: placement is atomic on the GPU)
    assert blocks.tolist() == [0, 1, 3, 3, 4, 4, 4, 4]
    rows = pairs.tolist()
    assert sorted(rows[0:2]) == [1, 4] and rows[2:4] == [3, -1] and sorted(rows[4:8]) == [0, 2, 5, 7]
    assert rows[8:] == [-1] * 8


def test_moe_module_uses_kernel_and_matches(dev, monkeypatch, launches):
    """MoE.routed on the Triton path (stacked weights, views) equals its reference loop."""
    cfg = ModelConfig.from_dict(TINY_CONFIG)
    moe = init_random_(build(MoE, cfg, device=dev), 0, std=0.2)
    x = torch.randn(11, cfg.hidden_size, device=dev)
    monkeypatch.setenv(dispatch.ENV, "reference")
    ref = moe(x) if dev == "cpu" else None
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = moe(x)
    w13, w2 = moe._stacked
    assert moe.experts["3"].up_proj.weight.data_ptr() == w13[3, cfg.moe_intermediate_size:].data_ptr()
    with torch.no_grad():                                                   # loader-style in-place write
        moe.experts["3"].down_proj.weight.mul_(0)
    assert w2[3].abs().max() == 0
    monkeypatch.setenv(dispatch.ENV, "reference")
    ref = moe(x)                                                            # the dense loop on CUDA
    monkeypatch.setenv(dispatch.ENV, "triton")
    got = moe(x)
    assert rel(got, ref) <= 1e-5


def test_router_is_fp32_under_autocast():
    cfg = ModelConfig.from_dict(TINY_CONFIG)
    moe = init_random_(build(MoE, cfg), 0, std=0.2)
    x = torch.randn(6, cfg.hidden_size)
    w, ids = moe.gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w2, ids2 = moe.gate(x)
    assert w2.dtype == torch.float32 and torch.equal(w, w2) and torch.equal(ids, ids2)


# --- whole model --------------------------------------------------------------------------------------------

def test_greedy_generate_triton_equals_reference(dev, monkeypatch, launches):
    """A tiny target (MLA + dense + MoE layers) decodes the same tokens on both paths, with two requests
    of different lengths sharing steps in between (the verify-like multi-row step)."""
    model = tiny_model(seed=5).to(dev)
    prompt = tokens(21, model.cfg.vocab_size, seed=2)
    outs, hiddens = {}, {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv(dispatch.ENV, mode)
        outs[mode] = greedy_generate(model, prompt, 6, cache=new_cache(model, num_blocks=32, block_size=4))
        cache = new_cache(model, num_blocks=32, block_size=4)
        h = [forward_tokens(model, cache, {"a": prompt[:13], "b": prompt[:5]}),
             forward_tokens(model, cache, {"b": prompt[5:9], "a": prompt[13:14]})]
        hiddens[mode] = torch.cat(h)
    assert outs["triton"] == outs["reference"]
    assert rel(hiddens["triton"], hiddens["reference"]) <= 1e-5
    assert dev == "cuda" or launches["_mla_kernel"] > 0 and launches["_gate_up_kernel"] > 0


# --- CUDA only: graph capture, FlashInfer ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
def test_forward_replays_in_cuda_graph(monkeypatch):
    """Capture one decode step of two requests with static metadata buffers, then replay it for later
    steps by rewriting the buffers in place: the same hidden states as eager forwards."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    model = tiny_model(seed=6).cuda()
    cache = new_cache(model, num_blocks=64, block_size=4)
    forward_tokens(model, cache, {"a": tokens(10, 512, 1), "b": tokens(3, 512, 2)})
    width = 16                                                              # fixed table width
    step = cache.prepare(["a", "b"], [1, 1])
    tables = torch.zeros(2, width, dtype=torch.int32, device="cuda")
    static = dataclasses.replace(step, positions=step.positions.clone(), slot_mapping=step.slot_mapping.clone(),
                                 token_request=step.token_request.clone(), context_lens=step.context_lens.clone(),
                                 block_tables=tables, plans={}, attention_backend="triton")
    tables[:, : step.block_tables.shape[1]] = step.block_tables
    ids = torch.tensor([5, 6], device="cuda")
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager = model(ids, static, cache)                               # warm-up: compiles, stacks experts
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, static, cache)
        graph.replay()
        assert rel(out, eager) <= 1e-5
        for t in range(6):                                                  # crosses block boundaries
            nxt = cache.prepare(["a", "b"], [1, 1])
            for name in ("positions", "slot_mapping", "token_request", "context_lens"):
                getattr(static, name).copy_(getattr(nxt, name))
            tables.zero_()[:, : nxt.block_tables.shape[1]] = nxt.block_tables
            ids.copy_(torch.tensor([7 + t, 9 + t], device="cuda"))
            want = model(ids.clone(), nxt, cache)
            graph.replay()
            assert rel(out, want) <= 1e-5, t


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
@pytest.mark.skipif(not flashinfer_mla.available(), reason="flashinfer is not installed (or does not import)")
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_flashinfer_mla_matches_reference(block_size, monkeypatch):
    cache, batch, q_lat, q_pe = attention_case("cuda", torch.bfloat16, 16, 512, 64, block_size, MIXED)
    assert flashinfer_mla.supported(q_lat, q_pe, cache.ckv[0])
    ctx = [s + n for s, n in zip(batch.host_starts, batch.query_lens)]
    wrapper = flashinfer_mla.plan(q_lat.device, batch.query_lens, ctx, batch.host_block_tables, 16, 512, 64,
                                  block_size, 0.1, torch.bfloat16)
    out = flashinfer_mla.run(wrapper, q_lat, q_pe, cache.ckv[0], cache.kpe[0])
    ref = latent_attention(q_lat.float(), q_pe.float(), batch, cache.ckv[0].float(), cache.kpe[0].float(), 0.1)
    assert rel(out, ref) <= 2e-2
    monkeypatch.setenv(dispatch.ATTENTION_ENV, "auto")
    assert dispatch.attention_backend(q_lat, q_pe, cache.ckv[0]) == "flashinfer"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
@pytest.mark.parametrize("shape", [(16, 512, 64, 64), (128, 512, 64, 16)])
def test_mla_deepseek_shapes_on_cuda(shape):
    h, R, P, bs = shape
    cache, batch, q_lat, q_pe = attention_case("cuda", torch.bfloat16, h, R, P, bs, MIXED)
    out = mla_attention_triton(q_lat, q_pe, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request,
                               batch.positions, batch.context_lens, 0.1)
    ref = latent_attention(q_lat.float(), q_pe.float(), batch, cache.ckv[0].float(), cache.kpe[0].float(), 0.1)
    assert rel(out, ref) <= 2e-2


def test_attention_backend_choice(monkeypatch):
    q, p, c = torch.zeros(1, 1, 32), torch.zeros(1, 1, 16), torch.zeros(1, 4, 32)
    monkeypatch.delenv(dispatch.ATTENTION_ENV, raising=False)
    monkeypatch.setenv(dispatch.ENV, "reference")
    assert dispatch.attention_backend(q, p, c) == "reference"
    monkeypatch.setenv(dispatch.ATTENTION_ENV, "flashinfer")
    with pytest.raises(RuntimeError, match="TANDEM_ATTENTION=flashinfer"):
        dispatch.attention_backend(q, p, c)                                 # CPU tensors: never covered
    monkeypatch.setenv(dispatch.ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION"):
        dispatch.attention_backend(q, p, c)
    monkeypatch.setenv(dispatch.ATTENTION_ENV, "auto")
    monkeypatch.setenv(dispatch.ENV, "auto")
    assert dispatch.attention_backend(q, p, c) == "reference"                 # CPU, auto


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 512), (5, 2048), (3, 2, 96)])
def test_rms_norm_matches_reference(dev, dtype, shape, launches):
    """One launch for the eight ops of an eager RMSNorm; the same rounding steps as the reference (normalize
    in fp32, cast, then scale), so bf16 agrees to one rounding."""
    from kernels import norm, triton_norm
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(dev)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(dev)
    out, ref = triton_norm.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else TOL[dtype]), rel(out, ref)   # interp: bf16 truncates
    wide = triton_norm.rms_norm(x, w.float(), 1e-6)                        # fp32 weight: an fp32 result
    assert wide.dtype == torch.float32
    assert rel(wide, norm.rms_norm(x, w.float(), 1e-6)) <= (1e-6 if dtype == torch.float32 else TOL[dtype])
    assert dev == "cuda" or launches["_rms_norm_kernel"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_matches_reference(dev, dtype, interleave, launches):
    """DeepSeek's interleaved pairs and the indexer's half-split ones, on a strided slice (q's rope part)."""
    from kernels import norm, triton_norm
    g = torch.Generator().manual_seed(int(interleave))
    q = torch.randn(7, 4, 96, generator=g).to(dtype).to(dev)
    x = q[..., 32:]                                                          # [7, 4, 64], not contiguous
    pos = torch.tensor([0, 1, 5, 63, 200, 1023, 4095]).to(dev)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)).to(dev)
    out, ref = (f(x, pos, inv_freq, 1.2, interleave) for f in (triton_norm.rotary, norm.rotary))
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel(out, ref) <= (2e-5 if dtype == torch.float32 else 1e-2), rel(out, ref)
    assert not torch.allclose(ref.float(), (x * 1.2).float(), atol=1e-2)   # it does turn the vectors
    assert dev == "cuda" or launches["_rotary_kernel"] == 1


ROUTES = {   # name: (E, RouteSpec fields): DeepSeek-V3's grouped noaux_tc, V2-Lite-shape, V2's softmax ones
    "v3": (256, dict(sigmoid=True, n_group=8, topk_group=4, top_k=8, noaux=True, norm=True, scale=2.5)),
    "v2-lite": (64, dict(sigmoid=True, n_group=1, topk_group=1, top_k=6, noaux=True, norm=True, scale=1.0)),
    "softmax": (8, dict(sigmoid=False, n_group=1, topk_group=1, top_k=2, noaux=False, norm=False, scale=1.0)),
    "softmax-groups": (16, dict(sigmoid=False, n_group=4, topk_group=2, top_k=3, noaux=False, norm=True, scale=16.0)),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_router_choice_matches_reference(dev, name, launches):
    """The same experts in the same order (best first: the MoE sums its slots in that order) and the same
    weights, for the routers DeepSeek's models use."""
    from kernels import router, triton_router
    E, fields = ROUTES[name]
    spec = router.RouteSpec(**fields)
    g = torch.Generator().manual_seed(E)
    logits = (torch.randn(37, E, generator=g) * 2).to(dev)
    bias = (torch.randn(E, generator=g) * 0.1).to(dev) if spec.noaux else None
    assert triton_router.supported(E, spec)
    (w, ids), (rw, rids) = triton_router.select(logits, bias, spec), router.select(logits, bias, spec)
    assert ids.dtype == rids.dtype and torch.equal(ids.cpu(), rids.cpu())
    assert torch.allclose(w.cpu(), rw.cpu(), rtol=1e-5, atol=1e-6), (w - rw).abs().max()
    if spec.n_group > 1:                                   # only experts of the topk_group best groups
        groups = (ids // (E // spec.n_group)).cpu()
        assert all(len(set(row.tolist())) <= spec.topk_group for row in groups)
    assert dev == "cuda" or launches["_route_kernel"] == 1
    if bias is not None:          # a bf16 model's bias goes in as it is (no cast launch): the same choice
        b16 = bias.to(torch.bfloat16)
        for select in (triton_router.select, router.select):
            w1, ids1 = select(logits, b16, spec)
            w2, ids2 = select(logits, b16.float(), spec)
            assert torch.equal(ids1.cpu(), ids2.cpu()) and torch.equal(w1.cpu(), w2.cpu())


COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_mla as tm, triton_moe as tmo, triton_moe_group as tg, triton_norm as tn, triton_router as tr
MLA = dict(BLOCK_H=16, BLOCK_N=64, BLOCK_R=512, BLOCK_P=64, SPLITS=4, PER_MIN=4, KV_TILES=0, DYNAMIC_LOOP=True)
F32 = dict(ws_ptr="*fp32", ml_ptr="*fp32")
I32 = dict(pair_ptr="*i32", blk_ptr="*i32")
MOE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
KERNELS = [(tm._mla_kernel, dict.fromkeys(["ql_ptr", "qp_ptr", "ckv_ptr", "kpe_ptr", "out_ptr"], "*bf16"),
            dict(req_ptr="*i32", pos_ptr="*i64", clen_ptr="*i32", bt_ptr="*i32", **F32), {**MLA, "PRECISION": "tf32"}),
           (tm._mla_kernel, dict.fromkeys(["ql_ptr", "qp_ptr", "ckv_ptr", "kpe_ptr", "out_ptr"], "*fp32"),
            dict(req_ptr="*i32", pos_ptr="*i64", clen_ptr="*i32", bt_ptr="*i32", **F32),
            {**MLA, "BLOCK_N": 16, "SPLITS": 1, "PRECISION": "ieee"}),
           (tm._combine_kernel, dict(out_ptr="*bf16"), F32, dict(BLOCK_H=16, BLOCK_R=512, BLOCK_C=128, SPLITS=4)),
           (tmo._gate_up_kernel, dict.fromkeys(["x_ptr", "w_ptr", "sw_ptr", "h_ptr"], "*bf16"), I32,
            {**MOE, "PRECISION": "tf32"}),
           (tmo._down_kernel, dict.fromkeys(["h_ptr", "w_ptr", "sw_ptr", "out_ptr"], "*bf16"),
            dict(rw_ptr="*fp32", **I32),
            {**MOE, "PRECISION": "tf32"}),
           (tmo._down_kernel, dict.fromkeys(["h_ptr", "w_ptr", "sw_ptr"], "*bf16"),
            dict(rw_ptr="*fp32", out_ptr="*fp32", **I32),
            {**MOE, "BLOCK_N": 32, "BLOCK_K": 128, "PRECISION": "tf32"}),
           (tg._count_kernel, {}, dict(cnt_ptr="*i32"), dict(NB=512, BLOCK=32)),
           (tg._group_kernel, {}, I32, dict(NB=512, P=256, BLOCK_M=16, FILL=1024)),
           (tg._sum_pairs_kernel, dict(part_ptr="*fp32", y_ptr="*bf16", add_ptr="*bf16"), {},
            dict(KP=8, SPLIT=2, BLOCK=512, ADD=False)),
           (tg._sum_pairs_kernel, dict(part_ptr="*fp32", y_ptr="*bf16", add_ptr="*bf16"), {},
            dict(KP=8, SPLIT=1, BLOCK=512, ADD=True)),
           (tr._route_kernel, dict(logit_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", id_ptr="*i64"), {},
            dict(E=256, SIGMOID=True, HAS_BIAS=True, N_GROUP=8, TOPK_GROUP=4, TOP_K=8, NOAUX=True, NORM=True,
                 BLOCK_K=8)),
           (tr._logits_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32"), {},
            dict(BLOCK_E=4, BLOCK_D=1024)),
           (tn._rms_norm_kernel, dict.fromkeys(["x_ptr", "r_ptr", "w_ptr", "out_ptr", "sum_ptr"], "*bf16"), {},
            dict(BLOCK=2048, ADD=False)),
           (tn._rms_norm_kernel, dict.fromkeys(["x_ptr", "r_ptr", "w_ptr", "out_ptr", "sum_ptr"], "*bf16"), {},
            dict(BLOCK=2048, ADD=True)),
           (tn._silu_mul_kernel, dict.fromkeys(["gu_ptr", "out_ptr"], "*bf16"), {}, dict(BLOCK=1024)),
           (tn._rotary_kernel, dict.fromkeys(["x_ptr", "out_ptr"], "*bf16"), dict(pos_ptr="*i64", f_ptr="*fp32"),
            dict(BLOCK=32, INTERLEAVE=True)),
           (tg._place_kernel, {}, dict(cnt_ptr="*i32", fill_ptr="*i32", pair_ptr="*i32", blk_ptr="*i32"),
            dict(NB=512, BLOCK_M=16, BLOCK=32))]
for fn, ptrs, ints, consts in KERNELS:
    sig = {a: "constexpr" if a in consts else ptrs.get(a) or ints.get(a, "*i64") if a.endswith("_ptr") else
           "fp32" if a in ("scale_log2", "eps", "factor", "scale") else "i64" if a.startswith("s_") else "i32" for a in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32), options=dict(num_warps=4, num_stages=2))
    assert k.asm["cubin"], fn.__name__
    print("compiled", fn.__name__)
'''


@pytest.mark.parametrize("arch", [90])                                      # H200: sm_90
def test_kernels_compile_for_the_gpu_without_one(tmp_path, arch):
    compile_for_gpu(COMPILE, arch, tmp_path, expected=17)
