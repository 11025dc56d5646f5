"""The launches a decoder layer saves (issue 14): the MLA's cache writes with their norm and rotaries, the residual
add inside the norm after it, SwiGLU's gate and up as
one GEMM and one silu-times-up launch, the shared experts read in place by the fused MoE as more experts (or added
in its last launch where they cannot be), and norm / SwiGLU
outputs that are the first rows of a LINEAR_ROWS-row buffer, so dense_linear takes them without a copy.

Each fused form against the unfused one: exactly in fp32 (interp and cuda) and in bf16 on CUDA (the same rounding
steps; the interpreter truncates bf16, so there bf16 agrees to one rounding), and a whole tiny model's layers
against the layer-by-layer reference."""
import pytest
import torch

from kernel_backends import CUDA, NO_CUDA, dev, launches, rel, triton  # noqa: E402,F401

from kernels import mla, norm, triton_norm  # noqa: E402
from kernels.triton_mla_write import write_latent_triton  # noqa: E402
from kernels.triton_moe import fused_moe_triton  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.layers import LINEAR_ROWS, buffer_rows, dense_linear  # noqa: E402
from models.loader import build, save_checkpoint  # noqa: E402
from models.model import TargetModel  # noqa: E402
from models.layers import stacked  # noqa: E402
from models.moe import MLP, MoE  # noqa: E402
from models.tiny import TINY_CONFIG, init_random_  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def same(a: torch.Tensor, b: torch.Tensor, dev: str) -> bool:
    """Bit for bit where both sides round alike (fp32; bf16 compiled), else within one bf16 rounding."""
    if a.dtype == torch.float32 or dev == "cuda":
        return torch.equal(a.cpu(), b.cpu())
    return rel(a, b) <= 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_add_then_the_norm(dev, dtype, launches):
    g = torch.Generator().manual_seed(3)
    x, r = ((torch.randn(5, 320, generator=g) * 4).to(dtype).to(dev) for _ in range(2))
    w = (torch.rand(320, generator=g) + 0.5).to(dtype).to(dev)
    s, out = triton_norm.rms_norm(x, w, 1e-6, residual=r, pad=16)
    assert dev == "cuda" or launches["_rms_norm_kernel"] == 1                 # the add and the norm: one launch
    assert s.shape == out.shape == (5, 320) and s.dtype == out.dtype == dtype
    assert same(s, x + r, dev)                                                # torch's add
    assert torch.equal(out.cpu(), triton_norm.rms_norm(s, w, 1e-6).cpu())     # then the one-launch norm of it
    assert rel(out, norm.add_rms_norm(x, r, w, 1e-6)[1]) <= (1e-6 if dtype == torch.float32 else 2e-2)
    assert out._base.shape == (16, 320) and out.data_ptr() == out._base.data_ptr()      # the padded buffer


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_gate_times_up(dev, dtype, launches):
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 2 * 1408, generator=g) * 3).to(dtype).to(dev)
    out, ref = triton_norm.silu_mul(gu, pad=8), norm.silu_mul(gu)
    assert out.shape == (3, 1408) and out._base.shape == (8, 1408)
    # tl.exp and torch's expf may differ in the last bit of fp32, which a bf16 result mostly hides
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 1e-2), rel(out, ref)
    assert dev == "cuda" or launches["_silu_mul_kernel"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_write_is_the_norm_and_rotaries_it_replaces(dev, dtype, interleave, launches):
    # V2-Lite's MLA widths (h 16, R 512, P 64) at 5 rows: q_pe and kv_a are views of the projections' outputs
    g = torch.Generator().manual_seed(6)
    N, H, R, P = 5, 16, 512, 64
    q = (torch.randn(N, H * 192 + 8, generator=g) * 2).to(dtype).to(dev)
    q_pe = q[:, :H * 192].view(N, H, 192)[..., 128:]                          # [N, h, P], row stride H * 192 + 8
    kv_a = (torch.randn(N, R + P + 32, generator=g) * 3).to(dtype).to(dev)[:, :R + P]
    w = (torch.rand(R, generator=g) + 0.5).to(dtype).to(dev)
    pos = torch.tensor([0, 7, 300, 4095, 12]).to(dev)
    slots = torch.tensor([3, 40, 17, 0, 63]).to(dev)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, P, 2).float() / P)).to(dev)
    (ckv, kpe), (ckv2, kpe2), (ckv3, kpe3) = ((torch.zeros(4, 16, R, dtype=dtype, device=d),
                                                torch.zeros(4, 16, P, dtype=dtype, device=d))
                                               for d in (dev, dev, "cpu"))
    out = write_latent_triton(q_pe, kv_a, w, 1e-6, pos, inv_freq, 0.7, interleave, slots, ckv, kpe)
    assert dev == "cuda" or launches["_write_kernel"] == 1 and sum(launches.values()) == 1   # one launch
    # the separate one-launch kernels, written as the layer wrote them before: bit for bit
    ref_q = triton_norm.rotary(q_pe, pos, inv_freq, 0.7, interleave)
    ckv2.view(-1, R)[slots] = triton_norm.rms_norm(kv_a[:, :R], w, 1e-6)
    kpe2.view(-1, P)[slots] = triton_norm.rotary(kv_a[:, None, R:], pos, inv_freq, 0.7, interleave)[:, 0]
    assert out.shape == (N, H, P) and out.dtype == dtype
    assert torch.equal(out.cpu(), ref_q.cpu())
    assert torch.equal(ckv.cpu(), ckv2.cpu()) and torch.equal(kpe.cpu(), kpe2.cpu())
    # and the PyTorch reference, to rounding; slots nobody wrote stay untouched
    ref = mla.write_latent(q_pe.cpu(), kv_a.cpu(), w.cpu(), 1e-6, pos.cpu(), inv_freq.cpu(), 0.7, interleave,
                           slots.cpu(), ckv3, kpe3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(out, ref) <= tol and rel(ckv, ckv3) <= tol and rel(kpe, kpe3) <= tol
    written = torch.zeros(64, dtype=torch.bool)
    written[slots.cpu()] = True
    assert not ckv.view(-1, R)[~written.to(dev)].any() and not kpe.view(-1, P)[~written.to(dev)].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_adds_the_shared_experts_in_its_last_launch(dev, dtype, launches):
    g = torch.Generator().manual_seed(5)
    N, D, I, E, k = 6, 96, 40, 8, 2
    x = torch.randn(N, D, generator=g).to(dtype).to(dev)
    w13 = (torch.randn(E, 2 * I, D, generator=g) * 0.1).to(dtype).to(dev)
    w2 = (torch.randn(E, D, I, generator=g) * 0.1).to(dtype).to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(dev)
    weights = torch.rand(N, k, generator=g).to(dev)
    shared = torch.randn(N, D, generator=g).to(dtype).to(dev)
    routed = fused_moe_triton(x, w13, w2, weights, ids, 0)
    launches.clear()
    both = fused_moe_triton(x, w13, w2, weights, ids, 0, add=shared)
    assert same(both, routed + shared, dev)
    assert dev == "cuda" or launches["_sum_pairs_kernel"] == 1 and sum(launches.values()) == 4   # no add launch
    assert torch.equal(fused_moe_triton(x[:0], w13, w2, weights[:0], ids[:0], 0, add=shared[:0]).cpu(),
                       shared[:0].cpu())


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_layer_reads_its_shared_experts_in_place(dev, fp8, monkeypatch, launches):
    """A MoE layer on the fused kernels: its shared experts (two routed experts' size here) read as experts inside the
    routed launches equal the same layer with them computed by their own GEMMs and added (TANDEM_SHARED_IN_MOE=0),
    and no GEMM or SwiGLU launch of theirs remains (the kernels' own test covers a rank holding part of the routed
    experts: tests/test_moe_kernels.py)."""
    monkeypatch.setenv("TANDEM_KERNELS", "triton")
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "hidden_size": 128, "moe_intermediate_size": 128,
                                 "n_shared_experts": 2, **({"quantization": "fp8"} if fp8 else {})})
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    layer = init_random_(MoE(cfg), 0, 0.05).to(dt).to(dev)
    if fp8:                                                                    # fp8 weights as a checkpoint has them
        from kernels import fp8 as f8
        for m in layer.modules():
            if hasattr(m, "weight_scale_inv"):
                q, s = f8.quantize_weight(m.weight.data.float())
                m.weight.data, m.weight_scale_inv.data = q.to(dev), s.to(dev)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(dt).to(dev)
    with torch.no_grad():
        assert layer.shared_for_kernels(5) is not None and layer.shared_for_kernels(4096) is None   # prefill: cuBLAS
        inside = layer(x)
        counted = dict(launches)
        monkeypatch.setenv("TANDEM_SHARED_IN_MOE", "0")
        assert layer.shared_for_kernels(5) is None
        launches.clear()
        added = layer(x)
    assert rel(inside, added) <= (1e-5 if dev == "cpu" else 3e-2 if fp8 else 1e-2)
    if dev == "cpu":
        assert "_silu_mul_kernel" not in counted and launches["_silu_mul_kernel"] == 1
        assert counted["_sum_pairs_kernel"] == 1


def test_stacked_gate_up_is_a_view_and_takes_loads():
    mlp = MLP(16, 24)
    for p, v in ((mlp.gate_proj.weight, 1.0), (mlp.up_proj.weight, 2.0), (mlp.down_proj.weight, 0.5)):
        p.data.fill_(v)
    w = stacked(mlp.gate_proj.weight, mlp.up_proj.weight)                      # first call: stacked, params re-pointed
    assert w.shape == (48, 16) and w[:24].eq(1).all() and w[24:].eq(2).all()
    assert mlp.gate_proj.weight.data_ptr() == w.data_ptr()
    mlp.up_proj.weight.data.copy_(torch.full((24, 16), 3.0))                  # an in-place load lands in the stack
    again = stacked(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert again.data_ptr() == w.data_ptr() and again[24:].eq(3).all()       # adjacent now: no copy
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = mlp(x)
    with torch.enable_grad():                                                  # training: the unfused path
        unfused = mlp(x)
    assert torch.allclose(fused, unfused.detach(), rtol=1e-6, atol=1e-6)


def test_checkpoint_of_a_model_that_ran_saves(tmp_path):
    """After a forward, gate and up (and a MoE's experts) are views of one stack: each is saved on its own."""
    model = init_random_(build(TargetModel, ModelConfig.from_dict(TINY_CONFIG)), 0, 0.05)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), None, None)
    sd = model.state_dict()
    gate = next(n for n in sd if n.endswith("mlp.gate_proj.weight"))
    assert sd[gate].untyped_storage().nbytes() > sd[gate].numel() * sd[gate].element_size()   # a view
    save_checkpoint(sd, tmp_path / "ckpt", max_shard_bytes=1 << 30)
    from safetensors.torch import load_file
    back = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(back[gate], sd[gate])


@pytest.mark.parametrize("inference", [False, True])
def test_buffer_rows_finds_the_padded_buffer_under_inference_mode(inference):
    """The engines run under torch.inference_mode, where a view keeps no _base: dense_linear found its padded buffers
    by _base, so every projection fed by a norm or by up_values was copied first (2 copies a layer on the H200)."""
    with torch.inference_mode(inference):
        buf = torch.arange(LINEAR_ROWS * 8, dtype=torch.float32).view(LINEAR_ROWS, 8)
        rows = buffer_rows(buf[:3].view(3, 8), LINEAR_ROWS)
        assert rows is not None and rows.shape == (LINEAR_ROWS, 8) and rows.data_ptr() == buf.data_ptr()
        assert torch.equal(rows, buf)
        assert torch.equal(buffer_rows(buf[2:3], 4), buf[2:6])             # from x's first row on
        assert buffer_rows(buf[LINEAR_ROWS - 2:], 4) is None                 # the storage ends first
        assert buffer_rows(torch.zeros(3, 8), LINEAR_ROWS) is None           # a tensor of its own
        assert buffer_rows(buf[:3, :4], LINEAR_ROWS) is None                 # not contiguous


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("inference", [False, True])
def test_dense_linear_takes_a_padded_buffer_as_it_is(inference):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(6)
    w = torch.randn(576, 2048, generator=g).bfloat16().cuda()
    x = torch.randn(3, 2048, generator=g).bfloat16().cuda()
    with torch.inference_mode(inference):
        buf = torch.empty(LINEAR_ROWS, 2048, dtype=torch.bfloat16, device="cuda")
        buf[:3] = x
        normed = triton_norm.rms_norm(x, torch.ones(2048, dtype=torch.bfloat16, device="cuda"), 1e-6,
                                      pad=LINEAR_ROWS)
        alone = [x.clone(), normed.clone()]
        with Copies():
            got = [dense_linear(buf[:3], w), dense_linear(normed, w)]
        assert Copies.n == 0                                                  # both taken as they are
        with Copies():
            want = [dense_linear(a, w) for a in alone]
        assert Copies.n == 2                                                  # a tensor of its own is copied
    assert all(torch.equal(a, b) for a, b in zip(got, want))                  # the same 128-row GEMM class


def test_model_with_deferred_residuals_equals_the_layer_by_layer_sum():
    """DeepseekV3Model adds each layer's MLP output inside the next layer's input norm (and the last inside the
    final norm): the same numbers as x = x + attn(norm(x)); x = x + mlp(norm(x)) layer by layer."""
    model = init_random_(build(TargetModel, ModelConfig.from_dict(TINY_CONFIG)), 1, 0.05).model
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, None, None)
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), None, None)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        ref = model.norm(x)
    assert torch.equal(out, ref)
    assert not torch.equal(out, model.norm(model.embed_tokens(ids)))          # the layers did something

