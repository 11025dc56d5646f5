"""MLA prefill (issue 17): the flash-style absorbed Triton kernel (kernels/triton_mla_prefill.py) and the expanded
form (kernels/mla_expanded.py) against the PyTorch reference (kernels/mla.py) on ragged batches: whole prompts,
chunks whose earlier keys are cached (chunked prefill, prefix hits), decode rows mixed in, block sizes, tiles
ending on the causal edge; the step's choice of form (kernels/dispatch.prefill_form); a tiny model's hidden
states and greedy tokens on each form; the kernel compiled for sm_90 without a GPU.

`interp` runs the kernel on CPU tensors under TRITON_INTERPRET=1, `cuda` compiles it (skipped without CUDA),
as tests/test_model_kernels.py. fp32 within 1e-5 of the reference, bf16 within 2 %.
"""

import pytest
import torch

from kernel_backends import BACKENDS, CUDA, INTERP, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401,F811

from kernels import dispatch  # noqa: E402
from kernels.mla import latent_attention  # noqa: E402
from kernels.mla_expanded import expanded_attention  # noqa: E402
from kernels.triton_mla_prefill import block_sizes, mla_prefill_triton, plan_tiles  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.kv_cache import PagedKVCache  # noqa: E402
from models.loader import build  # noqa: E402
from models.model import TargetModel  # noqa: E402
from models.runner import forward_tokens, greedy_generate, new_cache  # noqa: E402
from models.tiny import TINY_CONFIG, init_random_  # noqa: E402
from triton_cubin import compile_for_gpu  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# steps of {request: new tokens}; the last is the one checked
CASES = {
    "whole": [{"a": 37}],
    "chunks": [{"a": 30, "c": 3}, {"a": 21, "b": 40, "c": 1}],           # a: start 30, b new, c decodes
    "edges": [{"a": 16}, {"a": 16, "b": 32}],                            # tiles end on block / tile edges
    "mixed": [{"old": 23, "gone": 5}, {"dec": 9, "old": 1}, {"dec": 1, "old": 19, "new": 13}],
}


def case(dev, dtype, h, R, P, block_size, steps, nope=16, v=8, seed=0, blocks=96):
    """A cache of random contents grown by `steps`; the last step's batch and random queries / kv_b weight."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, blocks, block_size, R, P, dtype=dtype, device=dev)
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    for step in steps:
        for r in step:
            if r not in cache:
                cache.allocate(r)
        batch = cache.prepare(list(step), list(step.values()))
    N = batch.num_tokens
    q_nope, q_pe = (torch.randn(N, h, d, generator=g).to(dtype).to(dev) for d in (nope, P))
    w_kv = (torch.randn(h, nope + v, R, generator=g) / R ** 0.5).to(dtype).to(dev)
    return cache, batch, q_nope, q_pe, w_kv


def absorbed(batch, q_lat, q_pe, cache, scale, **kw):
    tiles = plan_tiles(batch.query_lens, batch.host_starts, block_sizes(q_lat.shape[1])[0]).to(q_lat.device)
    longest = max(s + n for s, n in zip(batch.host_starts, batch.query_lens))
    return mla_prefill_triton(q_lat, q_pe, cache.ckv[0], cache.kpe[0], batch.block_tables, batch.token_request,
                              batch.positions, batch.context_lens, tiles, scale, longest, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(4, 32, 16, 4), (20, 48, 8, 16)])     # h (20: two head blocks), R, P, block size
def test_absorbed_prefill_matches_reference(dev, dtype, name, shape, launches):
    h, R, P, bs = shape
    cache, batch, q_nope, q_pe, _ = case(dev, dtype, h, R, P, bs, CASES[name])
    q_lat = torch.randn(q_nope.shape[0], h, R, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    out = absorbed(batch, q_lat, q_pe, cache, 0.17, block_n=16 if dev == "cpu" else 32)   # one compile, no tuning
    ref = latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], 0.17)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) <= TOL[dtype], rel(out, ref)
    assert dev == "cuda" or launches["_prefill_kernel"] == 1


@pytest.mark.parametrize("block_n", [16, 32])
def test_absorbed_prefill_key_tiles_wider_than_blocks(dev, block_n, launches):
    """Key tiles spanning several cache blocks (block size 1 and 4) and rows of a tile crossing them."""
    for bs in (1, 4):
        cache, batch, q_nope, q_pe, _ = case(dev, torch.float32, 4, 32, 16, bs, CASES["chunks"], seed=bs)
        q_lat = torch.randn(q_nope.shape[0], 4, 32, generator=torch.Generator().manual_seed(2)).to(dev)
        out = absorbed(batch, q_lat, q_pe, cache, 0.3, block_n=block_n)
        assert rel(out, latent_attention(q_lat, q_pe, batch, cache.ckv[0], cache.kpe[0], 0.3)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_expanded_prefill_matches_reference(dtype, name):
    """The expanded form equals the absorbed reference followed by W_UV (same math, other association)."""
    dev = "cuda" if CUDA and not INTERP else "cpu"
    h, R, P, nope, v = 4, 32, 16, 16, 8
    cache, batch, q_nope, q_pe, w_kv = case(dev, dtype, h, R, P, 4, CASES[name], nope=nope, v=v)
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_kv[:, :nope].float())
    lat = latent_attention(q_lat, q_pe.float(), batch, cache.ckv[0].float(), cache.kpe[0].float(), 0.2)
    ref = torch.einsum("nhr,hvr->nhv", lat, w_kv[:, nope:].float())
    out = expanded_attention(q_nope, q_pe, batch, cache.ckv[0], cache.kpe[0], w_kv, 0.2)
    assert out.shape == (q_nope.shape[0], h, v) and out.dtype == dtype
    assert rel(out, ref) <= TOL[dtype], rel(out, ref)


def test_tiles_cover_each_row_once_within_one_request():
    lens, starts = [5, 1, 13, 8], [0, 40, 7, 100]
    tiles = plan_tiles(lens, starts, 4).tolist()
    rows = [r for a, e in tiles for r in range(a, e)]
    assert sorted(rows) == list(range(sum(lens))) and all(0 < e - a <= 4 for a, e in tiles)
    first = torch.tensor([0, 5, 6, 19])                                      # each request's first row
    req = [int((first <= a).sum()) - 1 for a, _ in tiles]
    assert all(int((first <= e - 1).sum()) - 1 == b for (_, e), b in zip(tiles, req))   # one request per tile
    sees = [starts[b] + e - int(first[b]) for (_, e), b in zip(tiles, req)]
    assert sees == sorted(sees, reverse=True)                                # most keys first
    assert block_sizes(16) == (4, 16) and block_sizes(4) == (16, 4) and block_sizes(128) == (4, 16)


def test_prefill_form_choice(monkeypatch):
    cache, batch, _, q_pe, _ = case("cpu", torch.float32, 4, 32, 16, 4, [{"a": 70, "b": 1}])
    ckv = cache.ckv[0]
    monkeypatch.delenv(dispatch.PREFILL_ENV, raising=False)
    monkeypatch.delenv(dispatch.ATTENTION_ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")      # CPU tensors: the interpreter, also on a machine with a GPU
    assert dispatch.prefill_form(q_pe, ckv, batch) is None                   # auto: CUDA only
    monkeypatch.setenv(dispatch.PREFILL_ENV, "expanded")
    assert dispatch.prefill_form(q_pe, ckv, batch) == "expanded"
    monkeypatch.setenv(dispatch.PREFILL_ENV, "absorbed")
    assert dispatch.prefill_form(q_pe, ckv, batch) == "absorbed"             # interpreted here
    batch.attention_backend = "triton"                                       # a CUDA graph's step
    assert dispatch.prefill_form(q_pe, ckv, batch) is None
    batch.attention_backend = None
    monkeypatch.setattr(dispatch, "PREFILL_MIN_ROWS", 70)                    # no request brings more rows
    assert dispatch.prefill_form(q_pe, ckv, batch) is None
    monkeypatch.setenv(dispatch.PREFILL_ENV, "off")
    monkeypatch.setattr(dispatch, "PREFILL_MIN_ROWS", 8)
    assert dispatch.prefill_form(q_pe, ckv, batch) is None
    monkeypatch.setenv(dispatch.PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match="TANDEM_PREFILL"):
        dispatch.prefill_form(q_pe, ckv, batch)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_tiny_model_prefill_forms_equal_reference(dev, form, monkeypatch, launches):
    """A tiny target's hidden rows over whole prompts, a chunk after cached keys next to a new prompt, and
    its greedy tokens: the same on the prefill form as on the reference attention (fp32)."""
    model = init_random_(build(TargetModel, ModelConfig.from_dict(TINY_CONFIG)), 5, 0.05).to(dev)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    monkeypatch.setattr(dispatch, "PREFILL_MIN_ROWS", 8)
    monkeypatch.setenv(dispatch.ENV, "reference" if dev == "cpu" else "triton")
    got = {}
    for mode in ("off", form):
        monkeypatch.setenv(dispatch.PREFILL_ENV, mode)
        cache = new_cache(model, num_blocks=32, block_size=4)
        h = [forward_tokens(model, cache, {"a": prompt[:21], "b": prompt[:3]}),
             forward_tokens(model, cache, {"a": prompt[21:35], "c": prompt[5:17]})]
        got[mode] = (torch.cat(h), greedy_generate(model, prompt, 5, cache=new_cache(model, 32, 4)))
    assert rel(got[form][0], got["off"][0]) <= 1e-5
    assert got[form][1] == got["off"][1]
    assert dev == "cuda" or form == "expanded" or launches["_prefill_kernel"] == 6   # 2 layers x 3 long steps


COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_mla_prefill as tp
PTRS = dict.fromkeys(["ql_ptr", "qp_ptr", "ckv_ptr", "kpe_ptr", "out_ptr"], "*bf16")
INTS = dict(req_ptr="*i32", pos_ptr="*i64", clen_ptr="*i32", bt_ptr="*i32", tile_ptr="*i32")
BASE = dict(BLOCK_M=4, BLOCK_H=16, BLOCK_R=512, BLOCK_P=64, KV_TILES=0, DYNAMIC_LOOP=True, PRECISION="tf32")
ALIGNED = ("s_qln", "s_qlh", "s_qpn", "s_qph", "s_cb", "s_cs", "s_kb", "s_ks", "s_on", "s_oh", "R", "P")
fn = tp._prefill_kernel
for cfg in tp.CONFIGS[:2]:                  # both key tiles, as the GPU's launch specializes them (strides % 16)
    consts = {**BASE, **cfg.kwargs}
    sig = {a: "constexpr" if a in consts else PTRS.get(a) or INTS.get(a) if a.endswith("_ptr") else
           "fp32" if a == "scale_log2" else "i64" if a.startswith("s_") else "i32" for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in fn.arg_names
             if a.endswith("_ptr") or a in ALIGNED}
    src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    assert k.asm["cubin"] and k.metadata.shared <= 227 * 1024, (cfg, k.metadata.shared)   # sm_90's shared memory
    print("compiled", cfg)
'''


@pytest.mark.skipif(CUDA and not INTERP, reason="CUDA is here: the cuda cases compile the kernel for this GPU")
@pytest.mark.parametrize("arch", [90])                                      # H200: sm_90
def test_prefill_kernel_compiles_for_the_gpu_without_one(tmp_path, arch):
    compile_for_gpu(COMPILE, arch, tmp_path, expected=2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
@pytest.mark.parametrize("steps", [[{"a": 1500}], [{"a": 1024}, {"a": 700, "b": 300}]])
def test_prefill_forms_deepseek_shapes_on_cuda(steps):
    """V2-Lite's attention shapes (16 heads, R 512, P 64, nope 128, v 128), bf16, the autotuned kernel."""
    h, R, P = 16, 512, 64
    cache, batch, q_nope, q_pe, w_kv = case("cuda", torch.bfloat16, h, R, P, 16, steps, nope=128, v=128, blocks=160)
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_kv[:, :128])
    lat = latent_attention(q_lat.float(), q_pe.float(), batch, cache.ckv[0].float(), cache.kpe[0].float(), 0.07)
    assert rel(absorbed(batch, q_lat, q_pe, cache, 0.07), lat) <= 2e-2
    ref = torch.einsum("nhr,hvr->nhv", lat, w_kv[:, 128:].float())
    assert rel(expanded_attention(q_nope, q_pe, batch, cache.ckv[0], cache.kpe[0], w_kv, 0.07), ref) <= 2e-2
