"""Checkpoint loading fails loudly and precisely (missing, mis-shaped, unknown tensors), sharded
checkpoints load identically, and ModelConfig rejects bad configs naming the field."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from conftest import read_tensors, write_checkpoint
from models.config import ConfigError, ModelConfig
from models.loader import CheckpointError, load_model, load_weights, quantize_fp8, save_checkpoint
from models.model import DraftModel, TargetModel
from models.tiny import TINY_CONFIG, make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """make_tiny's tensors (target + MTP layer, per-expert layout) and its raw config."""
    d = make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)
    return d, read_tensors(d), json.loads((d / "config.json").read_text())


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_clean_checkpoint_loads_every_parameter(tiny):
    d, tensors, _ = tiny
    for cls in (TargetModel, DraftModel):
        model = load_model(cls, d)
        report = load_weights(model, d)
        assert report == {"loaded": len(list(model.parameters())), "unused": []}, cls.__name__
        for name, p in model.named_parameters():
            assert torch.equal(p, tensors[model.checkpoint_names(name)[0]]), name


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.kv_b_proj.weight", "lm_head.weight",
                                  "model.layers.1.mlp.experts.3.up_proj.weight",
                                  "model.layers.1.mlp.gate.e_score_correction_bias"])
def test_missing_tensor_is_named(tiny, tmp_path, name):
    _, tensors, raw = tiny
    shape = list(tensors[name].shape)
    write_checkpoint(tmp_path, {k: v for k, v in tensors.items() if k != name}, raw)
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {name} (expected shape {shape})")):
        load_model(TargetModel, tmp_path)


def test_missing_mtp_tensor_fails_the_draft_only(tiny, tmp_path):
    _, tensors, raw = tiny
    write_checkpoint(tmp_path, {k: v for k, v in tensors.items() if k != "model.layers.2.eh_proj.weight"}, raw)
    load_model(TargetModel, tmp_path)
    with pytest.raises(CheckpointError, match=re.escape("missing tensor model.layers.2.eh_proj.weight")):
        load_model(DraftModel, tmp_path)


def test_misshaped_tensor_names_expected_and_actual(tiny, tmp_path):
    _, tensors, raw = tiny
    name = "model.layers.0.mlp.down_proj.weight"                      # [64, 128] in the checkpoint
    write_checkpoint(tmp_path, {**tensors, name: tensors[name].t().contiguous()}, raw)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} has shape [128, 64], expected [64, 128]")):
        load_model(TargetModel, tmp_path)


def fuse_experts(tensors, layer, E):
    """Per-expert -> transformers' fused layout for one layer (gate rows first)."""
    p = f"model.layers.{layer}.mlp.experts"
    out = {k: v for k, v in tensors.items() if not k.startswith(p + ".")}
    out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                       tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
    out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    return out


def test_fused_experts_load_and_are_shape_checked(tiny, tmp_path):
    d, tensors, raw = tiny
    E = raw["n_routed_experts"]
    fused = fuse_experts(tensors, 1, E)
    write_checkpoint(tmp_path / "ok", fused, raw)
    assert_same_state(state(load_model(TargetModel, tmp_path / "ok")), state(load_model(TargetModel, d)))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad = {**fused, name: fused[name][:, :48]}
    write_checkpoint(tmp_path / "bad", bad, raw)
    message = f"tensor {name} has shape [{E}, 48, 64], expected [{E}, 64, 64]"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(TargetModel, tmp_path / "bad")


def test_unknown_tensors_are_reported_once_not_used(tiny, tmp_path, caplog):
    d, tensors, raw = tiny
    extra = {"model.layers.0.self_attn.q_proj.weight": torch.ones(64, 64),  # this config has q_lora: no q_proj
             "model.layers.1.mlp.experts.8.gate_proj.weight": torch.ones(32, 64),  # expert 8 of 0..7
             "model.unknown_norm.weight": torch.ones(64)}
    write_checkpoint(tmp_path, {**tensors, **extra}, raw)
    model = load_model(TargetModel, d)
    with caplog.at_level(logging.WARNING, logger="tandem.loader"):
        report = load_weights(model, tmp_path)
    assert report["unused"] == sorted(extra)
    records = [r for r in caplog.records if r.name == "tandem.loader"]
    assert len(records) == 1 and all(n in records[0].getMessage() for n in extra)
    assert_same_state(state(model), state(load_model(TargetModel, d)))


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    d, tensors, raw = tiny
    save_checkpoint(tensors, tmp_path, max_shard_bytes=64 << 10)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for cls in (TargetModel, DraftModel):
        ref = state(load_model(cls, d))
        assert_same_state(state(load_model(cls, tmp_path)), ref)
        assert load_weights(load_model(cls, tmp_path), tmp_path)["unused"] == []
    (tmp_path / "model.safetensors.index.json").unlink()       # shards without an index: found by glob
    assert_same_state(state(load_model(TargetModel, tmp_path)), state(load_model(TargetModel, d)))


def test_not_a_checkpoint_and_fp8_without_scale(tiny, tmp_path):
    _, tensors, raw = tiny
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(TargetModel, tmp_path / "empty")
    name = "model.layers.0.self_attn.o_proj.weight"
    write_checkpoint(tmp_path / "fp8", {**tensors, name: quantize_fp8(tensors[name])[0]}, raw)
    with pytest.raises(CheckpointError, match=re.escape(f"{name} is fp8 but {name}_scale_inv is missing")):
        load_model(TargetModel, tmp_path / "fp8")


BAD_CONFIGS = [
    (dict(n_routed_experts=6, n_group=4), r"n_routed_experts \(6\) must be divisible by n_group \(4\)"),
    (dict(topk_group=3), r"topk_group must be in \[1, n_group=2\], got 3"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok must be in \[1, n_routed_experts=8\], got 9"),
    (dict(num_experts_per_tok=5, n_group=2, topk_group=1), r"num_experts_per_tok \(5\).*topk_group \(1\)"),
    (dict(moe_intermediate_size=0), r"moe_intermediate_size must be > 0"),
    (dict(qk_rope_head_dim=7), r"qk_rope_head_dim must be even, got 7"),
    (dict(hidden_size="64"), r"hidden_size must be a positive integer, got '64'"),
    (dict(num_hidden_layers=0), r"num_hidden_layers must be a positive integer, got 0"),
    (dict(scoring_func="relu"), r"scoring_func must be 'sigmoid' or 'softmax', got 'relu'"),
    (dict(topk_method="random"), r"topk_method 'random' is not supported"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), r"rope type 'longrope' is not supported"),
    (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers must be >= 0"),
    (dict(kv_lora_rank=None), r"kv_lora_rank"),
]


@pytest.mark.parametrize("override,message", BAD_CONFIGS)
def test_model_config_rejects_bad_fields(override, message):
    raw = {k: v for k, v in {**TINY_CONFIG, **override}.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith("config.json: ")


def test_model_config_reads_hf_names(tmp_path):
    raw = {k: v for k, v in TINY_CONFIG.items() if k not in ("num_nextn_predict_layers", "rope_theta")}
    cfg = ModelConfig.from_dict({**raw, "num_mtp_layers": 2,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e4,
                                                     "original_max_position_embeddings": 64,
                                                     "mscale_all_dim": 1.0}})
    assert cfg.num_nextn_predict_layers == 2 and cfg.rope.kind == "yarn" and cfg.rope.theta == 5e4
    assert cfg.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    with pytest.raises(ConfigError, match="no config.json at"):
        ModelConfig.from_file(tmp_path)
