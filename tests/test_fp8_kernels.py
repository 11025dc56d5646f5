"""DeepSeek's fp8 scheme: the PyTorch reference (kernels/fp8.py) against exact math, and the Triton kernels
(block-scaled GEMM kernels/triton_fp8.py, fused MoE kernels/triton_fp8_moe.py) against the reference.

Same two backends as tests/test_model_kernels.py: `interp` runs the kernels on CPU tensors under
TRITON_INTERPRET=1 (set here before triton is imported, on machines without CUDA), `cuda` compiles them
(skipped without CUDA). The interpreter multiplies the same fp8 values exactly, so it agrees with the
reference to fp32 rounding (1e-5); on the GPU fp8 tensor cores accumulate 128-wide blocks with fewer bits and
bf16 rounds the output: 2 % of the output's scale.
"""

import pytest
import torch

from kernel_backends import BACKENDS, CUDA, INTERP, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401,F811

from kernels import dispatch, fp8  # noqa: E402
from kernels import triton_fp8_config as fcfg  # noqa: E402
from kernels.triton_fp8 import fp8_linear_triton  # noqa: E402
from kernels.triton_fp8_config import Config, Tile  # noqa: E402
from kernels.triton_fp8_moe import fused_moe_fp8_triton  # noqa: E402
from triton_cubin import compile_for_gpu  # noqa: E402

TOL = {"cpu": 1e-5, "cuda": 2e-2}


def quantized(*shape, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * std
    return (w,) + fp8.quantize_weight(w)


# --- the reference --------------------------------------------------------------------------------------------

def test_weight_quantization_is_deepseeks_block_format():
    w, q, s = quantized(300, 200, seed=1)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    for r in range(3):                                     # every block's amax lands on 448 exactly
        for c in range(2):
            blk = q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float()
            assert blk.abs().max() == 448.0
    err = (fp8.dequantize_weight(q, s) - w).abs() / w.abs().max()
    assert err.max() < 2 ** -4 and err.mean() < 2 ** -7          # 3 mantissa bits


def test_activation_quantization_per_token_per_128_columns():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 300, generator=g)
    x[1, 128:256] *= 1000                                   # a loud group must not squash its neighbours
    x[2] = 0                                                 # an all-zero token stays zero
    q, s = fp8.quantize_act(x)
    assert s.shape == (3, 3)
    back = fp8.dequantize_act(q, s)
    assert torch.equal(back[2], torch.zeros(300))
    assert ((back[:2] - x[:2]).abs() <= x[:2].abs().amax(-1, keepdim=True) / 16).all()
    assert (back[1, :128] - x[1, :128]).abs().max() < 0.2


def test_fp8_linear_reference_close_to_exact():
    w, q, s = quantized(256, 384, seed=3)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(4))
    exact = x @ w.t()
    y = fp8.fp8_linear(x, q, s)
    err = (y - exact).norm() / exact.norm()
    assert 0.005 < err < 0.06, err                      # fp8 really rounds (not a bf16 matmul), and not badly
    assert fp8.fp8_linear(x.bfloat16(), q, s).dtype == torch.bfloat16


# --- the kernels against the reference ------------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K,split", [(1, 200, 300, None), (1, 200, 300, 3), (4, 130, 256, None),
                                         (17, 64, 100, 1), (33, 256, 512, 2), (70, 96, 130, None),
                                         (150, 130, 260, None)])
def test_fp8_gemm_matches_reference(dev, M, N, K, split, launches):
    _, q, s = quantized(N, K, seed=M + N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K))
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out = fp8_linear_triton(x.to(dt).to(dev), q.to(dev), s.to(dev), split_k=split)
    ref = fp8.fp8_linear(x.to(dt).float(), q, s)
    assert out.shape == (M, N) and out.dtype == dt
    assert rel(out, ref) <= TOL[dev], rel(out, ref)
    if dev == "cpu":
        cfg = fcfg.lookup(N, K, M, cublas=False)
        splits = split or cfg.split
        assert launches["_gemm_kernel"] == 1 and launches["_quant_kernel"] == int(not cfg.tile.fused)
        assert launches["_sum_splits_kernel"] == int(-(-K // 128) > 1 and splits > 1)


def one_of_each_kind(tiles) -> list:
    """The first tile of each (fused, swap, kstep) kind: the ones the interpreter runs (the GPU runs all)."""
    kinds: dict[tuple, Tile] = {}
    for t in tiles:
        kinds.setdefault((t.fused, t.swap, t.kstep), t)
    return list(kinds.values())


VARIANTS = one_of_each_kind(fcfg.TILES)


@pytest.mark.parametrize("tile", fcfg.TILES, ids=lambda t: "-".join(map(str, t)))
def test_fp8_gemm_variants_match_reference(dev, tile, launches):
    """Every tile the sweep may pick (pre-quantized or fused activations, swapped or not, 1 / 2 / 4 K tiles a
    stage), split so that the last split is short, with a K tail inside a tile and an N tail: the reference."""
    if dev == "cpu" and tile not in VARIANTS:
        pytest.skip("the interpreter runs one tile of each kind")
    M, N, K = 5, 192, 976                                 # 8 K tiles, the last 80 wide
    _, q, s = quantized(N, K, seed=3)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4)) * 3
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    ref = fp8.fp8_linear(x.to(dt).float(), q, s)
    for split in (1, 3):                                  # 3 splits of 3, 3 and 2 tiles
        out = fp8_linear_triton(x.to(dt).to(dev), q.to(dev), s.to(dev), cfg=Config(tile, split))
        assert rel(out, ref) <= TOL[dev], (split, rel(out, ref))


def test_row_classes_and_splits_come_from_the_shape_not_the_rows():
    assert [fcfg.row_class(m) for m in (1, 5, 8, 9, 16, 17, 128, 129)] == [8, 8, 8, 16, 16, 32, 128, fcfg.LARGE]
    for (N, K) in [(2048, 7168), (576, 7168), (24576, 1536), (2048, 10944), *fcfg.TABLE]:
        for lo, hi in [(1, 8), (9, 16), (17, 32), (33, 64), (65, 128)]:
            assert len({fcfg.lookup(N, K, m) for m in range(lo, hi + 1)}) == 1, (N, K, lo)
    tile = Tile(16, 64, 1, False, True, 4, 4)
    assert fcfg.split_for(2048, 7168, tile, 8, 2.0) == 8                  # 32 column blocks x 8 splits of 7 tiles
    assert fcfg.split_for(24576, 1536, tile, 8, 2.0) == 1                 # 384 column blocks already
    split = fcfg.split_for(576, 7168, tile, 8, 2.0)
    tiles = -(-56 // split)
    assert split * tiles >= 56 and (split - 1) * tiles < 56 and split * 9 >= 200
    assert fcfg.split_for(576, 7168, tile, 8, 0.0) == 1
    assert fcfg.lookup(2048, 7168, 300) is fcfg.CUBLAS and fcfg.lookup(2048, 7168, 300, cublas=False) is not None
    assert fcfg.lookup(2048, 10944, 300) is not None                       # no whole 128-blocks: Triton


def test_config_table_is_well_formed():
    """What the sweep writes stays inside what the kernel supports; cuBLAS only above 16 rows."""
    for (N, K), per_class in fcfg.TABLE.items():
        assert set(per_class) <= set(fcfg.CLASSES), (N, K)
        for cls, cfg in per_class.items():
            if cfg is fcfg.CUBLAS:
                assert cls > 16 and fcfg.cublas_fits(N, K), (N, K, cls)
                continue
            assert 1 <= cfg.split <= -(-K // 128) and cfg.tile in fcfg.TILES, (N, K, cls, cfg)
    assert {t for t, _ in fcfg.DEFAULTS.values()} <= set(fcfg.TILES)
    for t in fcfg.TILES:
        assert 128 % t.block_n == 0 and t.block_m >= 16 and t.kstep in (1, 2, 4) and t.warps in (4, 8), t


def test_fp8_rows_do_not_depend_on_their_neighbours(dev):
    """Within a row class a row's output bits are the same however many rows share the call (decode of 1 row
    == verify of K + 1 rows), for every tile kind; here with the class's config and with forced tiles."""
    N, K = 192, 528
    _, q, s = quantized(N, K, seed=8)
    q, s = q.to(dev), s.to(dev)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(5)).to(dt).to(dev)
    assert len(VARIANTS) == 7 and {t.kstep for t in VARIANTS} == {1, 2, 4}
    for cfg in [None, Config(VARIANTS[1], 2), Config(VARIANTS[3], 2)]:
        full = fp8_linear_triton(x[:8], q, s, cfg=cfg)
        for m in (1, 5):
            assert torch.equal(fp8_linear_triton(x[:m], q, s, cfg=cfg), full[:m]), (cfg, m)
    assert torch.equal(fp8_linear_triton(x[:9], q, s)[:9], fp8_linear_triton(x, q, s)[:9])     # class 9..16


def expert_weights(E, D, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1
    gate = [fp8.quantize_weight(w13[e, :I]) for e in range(E)]
    up = [fp8.quantize_weight(w13[e, I:]) for e in range(E)]
    down = [fp8.quantize_weight(w2[e]) for e in range(E)]
    return (torch.stack([torch.cat([a[0], b[0]]) for a, b in zip(gate, up)]),
            torch.stack([torch.cat([a[1], b[1]]) for a, b in zip(gate, up)]),
            torch.stack([d[0] for d in down]), torch.stack([d[1] for d in down]))


@pytest.mark.parametrize("case", ["uneven", "ep_shard", "block_m_64", "wide", "empty"])
def test_fp8_fused_moe_matches_reference(dev, case, launches):
    g = torch.Generator().manual_seed(5)
    N, D, I, E, k, first, block_m = 11, 96, 40, 8, 3, 0, None
    if case == "wide":                                    # several 128-blocks each way, I not a multiple of 128
        D, I = 300, 200
    N = 0 if case == "empty" else N
    w13, s13, w2, s2 = expert_weights(E, D, I)
    x = torch.randn(N, D, generator=g)
    probs = torch.tensor([8, 4, 2, 1, 1, 0, 0, 0.5])                        # experts 5, 6 get nothing
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(N)]) if N else torch.zeros(0, k).long()
    weights = torch.rand(N, k, generator=g)
    if case == "ep_shard":                                                  # this rank holds experts 2..5
        first, w13, s13, w2, s2 = 2, w13[2:6], s13[2:6], w2[2:6], s2[2:6]
    if case == "block_m_64":
        block_m = 64
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    ref = fp8.fused_moe_fp8(x.to(dt), w13, s13, w2, s2, weights, ids, first)
    out = fused_moe_fp8_triton(x.to(dt).to(dev), *(t.to(dev) for t in (w13, s13, w2, s2)), weights.to(dev),
                               ids.to(dev), first, block_m)
    assert out.shape == (N, D) and out.dtype == dt
    if N:
        assert rel(out, ref) <= TOL[dev], rel(out, ref)
        assert dev == "cuda" or launches["_gate_up_kernel"] == 1 and launches["_down_kernel"] == 1


def test_dispatch_runs_the_reference_on_cpu_and_without_triton(monkeypatch):
    _, q, s = quantized(64, 128)
    x = torch.randn(2, 128)
    monkeypatch.setenv("TANDEM_KERNELS", "reference")
    assert torch.equal(dispatch.fp8_linear(x, q, s), fp8.fp8_linear(x, q, s))


# --- GPU: DeepSeek-V3's decode shapes -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
@pytest.mark.parametrize("M", [1, 32, 128, 130, 300])                # 300: cuBLAS where it fits; 130: never
@pytest.mark.parametrize("N,K", [(2048, 7168), (7168, 2048), (576, 7168), (24576, 1536), (256, 256), (512, 128),
                                 (2048, 1408)])
def test_fp8_gemm_deepseek_shapes_on_cuda(M, N, K):
    _, q, s = quantized(N, K, seed=N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    out = fp8_linear_triton(x.cuda(), q.cuda(), s.cuda())
    assert rel(out, fp8.fp8_linear(x.float(), q, s)) <= TOL["cuda"]


def test_fp8_every_decode_class_of_a_shape_keeps_a_rows_bits():
    """What sets a row's bits on the H200 is the split and the MMA kind (BENCHMARKS.md "Lossless at any batch"):
    every decode class of each measured shape and of the rule shares both, and none is cuBLAS."""
    shapes = [*fcfg.TABLE, (1000, 3000), (512, 4096), (7168, 512), (129, 7168)]
    assert [shape for shape in shapes if not fcfg.invariant(*shape)] == []
    assert len({fcfg.wgmma(t) for c, (t, _) in fcfg.DEFAULTS.items() if c != fcfg.LARGE}) == 1
    assert not any(fcfg.cublas_fits(*s) for s in ((256, 256), (512, 128), (2048, 1408), (2048, 2048, 130)))
    assert fcfg.cublas_fits(2048, 7168, 300) and fcfg.lookup(2048, 7168, 129) is not fcfg.CUBLAS
    T = fcfg.Tile
    assert fcfg.wgmma(T(16, 64, 1, False, True, 4, 6)) and not fcfg.wgmma(T(16, 64, 1, False, False, 4, 6))
    assert not fcfg.wgmma(T(16, 64, 1, False, True, 2, 6)) and fcfg.wgmma(T(64, 32, 1, False, False, 4, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
@pytest.mark.parametrize("N,K", [(2048, 7168), (576, 7168), (1536, 7168), (3072, 2048), (2048, 10944), (576, 2048),
                                 (2048, 2048), (7168, 16384)])
def test_fp8_rows_do_not_depend_on_their_neighbours_on_cuda(N, K):
    """Decode (B rows) and verify (B (K + 1) rows) give a request's row the same bits with the shape's own
    configs (TABLE or the rule) from 1 to 128 rows: K = 3 equals K = 0 in fp8 at any batch up to 128 rows."""
    _, q, s = quantized(N, K, seed=9)
    q, s = q.cuda(), s.cuda()
    x = torch.randn(128, K, device="cuda").bfloat16()
    full = fp8_linear_triton(x, q, s)
    for m in (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100):
        assert torch.equal(fp8_linear_triton(x[:m], q, s), full[:m]), m


# --- compiled for sm_90 without a GPU -------------------------------------------------------------------------

COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_fp8 as tf, triton_fp8_config as fc, triton_fp8_moe as tfm
I32 = dict(pair_ptr="*i32", blk_ptr="*i32")
MOE = dict(BLOCK_M=16, BLOCK_K=128, PRECISION="tf32")
W = dict(w_ptr="*fp8e4nv", s_ptr="*fp32", sw_ptr="*fp8e4nv", ss_ptr="*fp32")
GATE_UP = dict(x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32", hs_ptr="*fp32", **W, **I32)
DOWN = dict(hq_ptr="*fp8e4nv", hs_ptr="*fp32", rw_ptr="*fp32", **W, **I32)
ALIGNED = ("N", "K", "s_xm", "s_wn", "s_om")   # what the JIT sees divisible by 16 at DeepSeek's shapes


def gemm(t, out):
    x = "*bf16" if t.fused else "*fp8e4nv"
    return (tf._gemm_kernel, dict(x_ptr=x, xs_ptr=x if t.fused else "*fp32", w_ptr="*fp8e4nv", s_ptr="*fp32",
                                  out_ptr=out),
            dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=128, KSTEP=t.kstep, FUSED=t.fused, SWAP=t.swap,
                 PRECISION="tf32"), t)


# the first class's and the prefill default (pre-quantized, swapped or not), and a fused one
tiles = [fc.DEFAULTS[8][0], fc.DEFAULTS[fc.LARGE][0], fc.TILES[5]]
KERNELS = [gemm(t, "*fp32" if i % 2 else "*bf16") for i, t in enumerate(tiles)]
KERNELS += [(tf._quant_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
             dict(GROUPS=tf.QUANT_GROUPS, BLOCK_K=128, EXACT=False), None),
            (tf._sum_splits_kernel, dict(ws_ptr="*fp32", out_ptr="*bf16"), dict(BLOCK=1024), None),
            (tfm._quant_act_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
            dict(BLOCK_R=16, BLOCK_K=128, EXACT=False), None),
            (tfm._prologue_kernel, dict(ids_ptr="*i64", x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", **I32),
            dict(NB=512, P=64, BLOCK_M=16, FILL=1024, BLOCK_R=16, BLOCK_K=128, EXACT=False), None),
            (tfm._gate_up_kernel, dict(h_ptr="*fp8e4nv", **GATE_UP), dict(BLOCK_N=128, QUANT_H=True, **MOE), None),
            (tfm._gate_up_kernel, dict(h_ptr="*bf16", **GATE_UP), dict(BLOCK_N=32, QUANT_H=False, **MOE), None),
            (tfm._down_kernel, dict(out_ptr="*bf16", **DOWN), dict(MOE, BLOCK_N=64), None),
            (tfm._down_kernel, dict(out_ptr="*fp32", **DOWN), dict(MOE, BLOCK_M=64, BLOCK_N=128), None)]
print(len(KERNELS), "kernels")
for fn, ptrs, consts, t in KERNELS:
    sig = {a: "constexpr" if a in consts else ptrs[a] if a.endswith("_ptr") else
           "i64" if a.startswith("s_") else "i32" for a in fn.arg_names}
    aligned = [a for a in fn.arg_names if t and (a.endswith("_ptr") or a in ALIGNED)]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()}, attrs)
    options = dict(num_warps=t.warps, num_stages=t.stages) if t else dict(num_warps=4, num_stages=3)
    k = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32), options=options)
    assert k.asm["cubin"], fn.__name__
    if t:   # the K loop is software-pipelined: the weight tiles of stages - 1 steps ahead sit in shared memory
        assert k.metadata.shared >= (t.stages - 1) * t.kstep * t.block_n * 128, (t, k.metadata.shared)
    print("compiled", fn.__name__, t or "")
'''


@pytest.mark.parametrize("arch", [90])                                      # H200: sm_90
def test_fp8_kernels_compile_for_the_gpu_without_one(tmp_path, arch):
    assert fcfg.TILES[5].fused and not fcfg.DEFAULTS[fcfg.LARGE][0].swap
    compile_for_gpu(COMPILE, arch, tmp_path, expected=11)


def fill_fp8_(module, seed: int, std: float = 0.2):
    """Random weights for a module that holds fp8 ones: N(0, std) quantized in blocks, norms one."""
    g = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("weight_scale_inv"):
                continue
            w = torch.randn(p.shape, generator=g) * (0.01 if name.endswith("bias") else std)
            if p.dtype == torch.float8_e4m3fn:
                q, s = fp8.quantize_weight(w)
                p.copy_(q.to(p.device))
                params[name + "_scale_inv"].copy_(s.to(p.device))
            else:
                p.copy_(w.to(p.device))
    return module


def test_fp8_moe_module_uses_the_fp8_kernel_and_matches_its_loop(dev, monkeypatch, launches):
    """MoE.routed with fp8 experts on the Triton path (stacked fp8 weights and scales, views) equals the
    reference loop over fp8 experts; the loader's in-place writes reach the stacked tensors."""
    from models.config import ModelConfig
    from models.loader import build
    from models.moe import MoE
    from models.tiny import TINY_CONFIG
    cfg = ModelConfig.from_dict(TINY_CONFIG).quantized("fp8")
    moe = fill_fp8_(build(MoE, cfg, device=dev), 0)
    assert moe.experts["0"].gate_proj.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(11, cfg.hidden_size, device=dev)
    monkeypatch.setenv(dispatch.ENV, "triton")
    moe(x)
    w13, s13, w2, s2 = moe._stacked
    assert moe.experts["3"].up_proj.weight_scale_inv.data_ptr() == s13[3, 1:].data_ptr()   # I = 32: one block
    with torch.no_grad():
        moe.experts["3"].down_proj.weight_scale_inv.mul_(0)
    assert s2[3].abs().max() == 0
    got = moe(x)
    monkeypatch.setenv(dispatch.ENV, "reference")
    ref = moe(x)                                                            # CPU: the loop; CUDA: dense
    assert rel(got, ref) <= TOL[dev]
    assert dev == "cuda" or launches["_gate_up_kernel"] == 2 and launches["_gemm_kernel"] == 6   # + shared x 3
