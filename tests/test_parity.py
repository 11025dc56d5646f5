"""TargetModel against transformers' DeepseekV3ForCausalLM (fp32, max relative error <= 1e-4), from both
checkpoint layouts transformers produces, for full prefill, cached decode and batched steps; and fp8
block-scaled checkpoints dequantized at load."""
from __future__ import annotations

import pytest
import torch

from conftest import YARN, hf_logits, hf_model, prefill_then_decode, read_tensors, rel_err, save_hf, tokens
from models.loader import dequantize_fp8, load_model, load_weights, quantize_fp8, save_checkpoint
from models.model import TargetModel
from models.runner import forward_tokens, new_cache

TOL = 1e-4
BLOCK = 16
PROMPT_LENS = (40, 17, 5)   # 40 spans three KV blocks of 16
CONFIGS = {
    "no_q_lora": dict(q_lora_rank=None),
    "groups_bias": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                        norm_topk_prob=True, bias_std=0.1),
    "yarn_q_lora": dict(q_lora_rank=48, rope_parameters=YARN, max_position_embeddings=256),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    """A randomized HF model, its two on-disk layouts, prompts and HF's logits for each."""
    overrides = dict(CONFIGS[request.param])
    hf = hf_model(seed=list(CONFIGS).index(request.param), **overrides)
    root = tmp_path_factory.mktemp(request.param)
    dirs = {layout: save_hf(hf, root / layout, layout) for layout in ("per_expert", "fused")}
    prompts = [tokens(n, hf.config.vocab_size, seed=n) for n in PROMPT_LENS]
    return dict(name=request.param, hf=hf, dirs=dirs, prompts=prompts,
                ref=[hf_logits(hf, p) for p in prompts])


@pytest.fixture(scope="module", params=["per_expert", "fused"])
def loaded(request, case):
    return case, load_model(TargetModel, case["dirs"][request.param])


def test_layouts_differ_as_expected(case):
    """save_pretrained splits the experts; the in-memory state dict keeps them fused [E, 2I, H] / [E, H, I]."""
    cfg = case["hf"].config
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = case["hf"].state_dict()
    assert tuple(fused["model.layers.1.mlp.experts.gate_up_proj"].shape) == (E, 2 * I, H)
    assert tuple(fused["model.layers.1.mlp.experts.down_proj"].shape) == (E, H, I)
    assert not any(".experts.0." in k for k in fused)
    split = read_tensors(case["dirs"]["per_expert"])
    assert tuple(split[f"model.layers.1.mlp.experts.{E - 1}.gate_proj.weight"].shape) == (I, H)
    assert tuple(split["model.layers.2.mlp.experts.0.down_proj.weight"].shape) == (H, I)
    assert "model.layers.1.mlp.experts.gate_up_proj" not in split
    on_disk = read_tensors(case["dirs"]["fused"])
    assert torch.equal(on_disk["model.layers.1.mlp.experts.gate_up_proj"],
                       fused["model.layers.1.mlp.experts.gate_up_proj"])
    if case["name"] == "groups_bias":   # the router bias really is non-zero (and saved)
        assert split["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def test_all_checkpoint_tensors_used(case):
    for layout, path in case["dirs"].items():
        model = load_model(TargetModel, path)
        assert load_weights(model, path)["unused"] == [], layout


def test_prefill_matches_transformers(loaded):
    case, model = loaded
    for ids, ref in zip(case["prompts"], case["ref"]):
        cache = new_cache(model, block_size=BLOCK)
        hidden = forward_tokens(model, cache, {"r": ids})
        err = rel_err(model.compute_logits(hidden), ref)
        assert err <= TOL, f"{case['name']} prompt of {len(ids)}: rel err {err:.2e}"


def test_prefill_then_decode_matches_transformers(loaded):
    case, model = loaded
    for ids, ref in zip(case["prompts"], case["ref"]):
        prefill = max(1, len(ids) // 3)
        logits = model.compute_logits(prefill_then_decode(model, ids, prefill, BLOCK))
        err = rel_err(logits, ref)
        assert err <= TOL, f"{case['name']} prompt of {len(ids)} (prefill {prefill}): rel err {err:.2e}"


def test_batched_steps_match_single_requests(loaded):
    """Two requests of different lengths share every step: a joint prefill, then a mixed step where one
    decodes a single token while the other appends three."""
    case, model = loaded
    (a, b), (ref_a, ref_b) = case["prompts"][:2], case["ref"][:2]
    cache = new_cache(model, block_size=BLOCK)
    h1 = forward_tokens(model, cache, {"a": a[:30], "b": b[:9]})
    h2 = forward_tokens(model, cache, {"b": b[9:12], "a": a[30:31]})
    h3 = forward_tokens(model, cache, {"a": a[31:], "b": b[12:]})
    logits = model.compute_logits(torch.cat([h1, h2, h3]))
    got_a = torch.cat([logits[:30], logits[39 + 3:39 + 4], logits[43:43 + 9]])
    got_b = torch.cat([logits[30:39], logits[39:42], logits[52:]])
    assert rel_err(got_a, ref_a) <= TOL
    assert rel_err(got_b, ref_b) <= TOL
    alone = model.compute_logits(forward_tokens(model, new_cache(model, block_size=BLOCK), {"b": b}))
    assert (got_b - alone).abs().max().item() <= 1e-5


def test_fp8_quantize_roundtrip_per_block():
    """Blocks of very different magnitude each keep their own scale (bound: e4m3 rounding)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(128)[:300, None]
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (3, 2)
    assert scale[2, 0] / scale[0, 0] > 100
    back = dequantize_fp8(q, scale)
    bound = w.abs() / 16 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] / 512
    assert ((back - w).abs() <= bound).all()
    assert rel_err(back, w) < 1 / 16


def test_fp8_checkpoint_loads_within_rounding(tmp_path):
    hf = hf_model(seed=7, bias_std=0.05)
    src = save_hf(hf, tmp_path / "fp32", "per_expert")
    tensors = read_tensors(src)
    fp8 = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight"):
            fp8[name], fp8[name + "_scale_inv"] = quantize_fp8(t)
        else:
            fp8[name] = t
    assert fp8["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert tuple(fp8["model.embed_tokens.weight_scale_inv"].shape) == (2, 1)   # vocab 256 = 2 row blocks
    dst = tmp_path / "fp8"
    save_checkpoint(fp8, dst)
    (dst / "config.json").write_text((src / "config.json").read_text())

    model = load_model(TargetModel, dst)
    assert load_weights(model, dst)["unused"] == []
    checked = 0
    for pname, p in model.named_parameters():
        name = model.checkpoint_names(pname)[0]
        if name not in fp8 or fp8[name].dtype != torch.float8_e4m3fn:
            continue
        w, scale = tensors[name], fp8[name + "_scale_inv"]
        assert torch.equal(p, dequantize_fp8(fp8[name], scale)), name
        per_elem = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        assert ((p - w).abs() <= w.abs() / 16 + per_elem / 512).all(), name
        checked += 1
    assert checked > 20

    # logits: exactly the model of the dequantized weights (checked through transformers), and near the
    # unquantized one (e4m3 noise on every matrix of a random model is ~10% of the logit scale)
    from transformers import DeepseekV3ForCausalLM
    deq = {n: dequantize_fp8(t, fp8[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
           for n, t in fp8.items() if not n.endswith("_scale_inv")}
    save_checkpoint(deq, tmp_path / "deq")
    (tmp_path / "deq" / "config.json").write_text((src / "config.json").read_text())
    hf_deq, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32,
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = tokens(40, hf.config.vocab_size, seed=3)
    got = model.compute_logits(forward_tokens(model, new_cache(model, block_size=BLOCK), {"r": ids}))
    err = rel_err(got, hf_logits(hf_deq.eval(), ids))
    assert err <= TOL, f"fp8 checkpoint vs transformers on the dequantized weights: rel err {err:.2e}"
    ref = hf_logits(hf, ids)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), 0).item()
    assert 0.97 < cos < 1 - 1e-6, f"fp8 logits vs unquantized: cosine {cos:.4f}"
