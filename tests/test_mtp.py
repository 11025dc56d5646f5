"""The MTP draft model: make_tiny checkpoints, MTP tensors added to a transformers-written checkpoint
(with or without the MTP layer's own embed/head), and the MTP math against transformers' MtpLayer."""
from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import hf_model, randomize_, read_tensors, rel_err, save_hf, tokens, write_checkpoint
from models.config import ModelConfig
from models.loader import build, load_model, load_weights
from models.model import DraftModel, TargetModel
from models.runner import forward_tokens, new_cache
from models.tiny import TINY_CONFIG, make_tiny

TOL = 1e-4
L = 2   # the HF model's num_hidden_layers: layer 0 dense, 1 MoE; its MTP layer is model.layers.2 (MoE)


def test_make_tiny_loads_as_target_and_draft(tmp_path):
    d = make_tiny(tmp_path, seed=0)
    target, draft = load_model(TargetModel, d), load_model(DraftModel, d)
    assert load_weights(target, d)["unused"] == [] and load_weights(draft, d)["unused"] == []
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)   # shared, as DeepSeek ships
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    # one propose over a prompt: the draft reads the target's hidden rows shifted by one
    ids = tokens(20, TINY_CONFIG["vocab_size"], seed=1)
    h = forward_tokens(target, new_cache(target), {"r": ids})
    cache = new_cache(draft)
    cache.allocate("r")
    with torch.inference_mode():
        logits = draft.compute_logits(draft(torch.tensor(ids[1:]), h[:-1], cache.prepare(["r"], [19]), cache))
    assert logits.shape == (19, TINY_CONFIG["vocab_size"]) and torch.isfinite(logits).all()
    assert logits.std() > 0 and cache.length("r") == 19


def test_make_tiny_is_deterministic(tmp_path):
    a, b, c = make_tiny(tmp_path / "a", 0), make_tiny(tmp_path / "b", 0), make_tiny(tmp_path / "c", 1)
    ta, tb, tc = read_tensors(a), read_tensors(b), read_tensors(c)
    assert ta.keys() == tb.keys() == tc.keys() and len(ta) > 50
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(ta[name], tc[name]), name
    for f in ("config.json", "tokenizer.json"):
        assert (a / f).read_text() == (b / f).read_text(), f
    deeper = make_tiny(tmp_path / "d", 0, {"num_hidden_layers": 3})
    assert "model.layers.3.eh_proj.weight" in read_tensors(deeper)
    assert json.loads((deeper / "config.json").read_text())["num_hidden_layers"] == 3


def test_draft_model_needs_an_mtp_layer():
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        build(DraftModel, cfg)


def mtp_layer(hf, seed: int):
    """transformers' own MTP layer for this config, randomized."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    assert hf.config._attn_implementation == "sdpa"       # a None mask is causal
    mtp = MtpLayer(hf.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=L).float().eval()
    return randomize_(mtp, seed, bias_std=0.05)


def mtp_checkpoint_tensors(mtp) -> dict[str, torch.Tensor]:
    """MtpLayer state under DeepSeek's checkpoint names, experts per expert like save_pretrained writes."""
    out = {}
    for k, v in mtp.state_dict().items():
        k = f"model.layers.{L}." + k.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        m = re.match(r"(.*\.experts)\.(gate_up_proj|down_proj)$", k)
        for e in range(v.shape[0] if m else 0):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down_proj.weight"] = v[e]
            else:
                out[f"{m.group(1)}.{e}.gate_proj.weight"], out[f"{m.group(1)}.{e}.up_proj.weight"] = v[e].chunk(2)
        if not m:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A transformers target + MtpLayer, and checkpoints = save_pretrained + the MTP layer's tensors."""
    hf = hf_model(seed=5, bias_std=0.05, num_hidden_layers=L, num_mtp_layers=1)
    mtp = mtp_layer(hf, seed=6)
    root = tmp_path_factory.mktemp("mtp")
    base = save_hf(hf, root / "hf", "per_expert")
    raw = json.loads((base / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and raw["num_hidden_layers"] == L
    tensors = {**read_tensors(base), **mtp_checkpoint_tensors(mtp)}
    g = torch.Generator().manual_seed(9)
    own = {f"model.layers.{L}.embed_tokens.weight": torch.randn(hf.model.embed_tokens.weight.shape, generator=g),
           f"model.layers.{L}.shared_head.head.weight": torch.randn(hf.lm_head.weight.shape, generator=g)}
    dirs = {"shared": write_checkpoint(root / "shared", tensors, raw),
            "own": write_checkpoint(root / "own", {**tensors, **own}, raw)}
    return dict(hf=hf, mtp=mtp, dirs=dirs, own=own, base=base)


@pytest.mark.parametrize("variant", ["shared", "own"])
def test_mtp_loads_from_transformers_checkpoint(hf_pair, variant):
    hf, mtp, d = hf_pair["hf"], hf_pair["mtp"], hf_pair["dirs"][variant]
    draft = load_model(DraftModel, d)
    assert load_weights(draft, d)["unused"] == []
    if variant == "own":
        assert torch.equal(draft.embed_tokens.weight, hf_pair["own"][f"model.layers.{L}.embed_tokens.weight"])
        assert torch.equal(draft.lm_head.weight, hf_pair["own"][f"model.layers.{L}.shared_head.head.weight"])
    else:   # falls back to the target's embedding and head
        assert torch.equal(draft.embed_tokens.weight, hf.model.embed_tokens.weight)
        assert torch.equal(draft.lm_head.weight, hf.lm_head.weight)
    layer, I = draft.mtp[0], hf.config.moe_intermediate_size
    assert torch.equal(layer.eh_proj.weight, mtp.eh_proj.weight)
    assert torch.equal(layer.enorm.weight, mtp.enorm.weight) and torch.equal(layer.hnorm.weight, mtp.hnorm.weight)
    assert torch.equal(layer.shared_head.norm.weight, mtp.post_norm.weight)
    experts = mtp.mtp_block.mlp.experts
    assert torch.equal(layer.mlp.experts["3"].up_proj.weight, experts.gate_up_proj[3, I:])
    assert torch.equal(layer.mlp.experts["5"].down_proj.weight, experts.down_proj[5])
    assert torch.equal(layer.mlp.gate.e_score_correction_bias, mtp.mtp_block.mlp.gate.e_score_correction_bias)
    # the target ignores the MTP tensors and loads exactly what it loads from the plain HF directory
    target = load_model(TargetModel, d)
    assert load_weights(target, d)["unused"] == []
    plain = load_model(TargetModel, hf_pair["base"]).state_dict()
    assert all(torch.equal(v, plain[k]) for k, v in target.state_dict().items())


def test_mtp_matches_transformers_mtp_layer(hf_pair):
    """MTP row i takes (embed(token[i+1]), h[i]); transformers places it at position i+1, we at i: RoPE
    is relative, so the two agree. Checked for a cached prefill, a prefill + one-row steps, and the
    uncached causal path."""
    hf, mtp, d = hf_pair["hf"], hf_pair["mtp"], hf_pair["dirs"]["shared"]
    T = 24                                                           # 23 MTP rows: two KV blocks of 16
    ids = tokens(T, hf.config.vocab_size, seed=2)
    with torch.no_grad():
        x = torch.tensor([ids])
        h_hf = hf.model(x).last_hidden_state                             # final-norm hidden [1, T, D]
        pos = torch.arange(1, T)[None]
        ref = mtp(inputs_embeds=hf.model.embed_tokens(x[:, 1:]), previous_hidden_state=h_hf[:, :-1],
                  position_embeddings=hf.model.rotary_emb(h_hf, pos), attention_mask=None,
                  position_ids=pos, cache=None)[0]                       # [T-1, D]
        ref_logits = hf.lm_head(ref)

    target, draft = load_model(TargetModel, d), load_model(DraftModel, d)
    h = forward_tokens(target, new_cache(target), {"r": ids})
    assert rel_err(h, h_hf[0]) <= TOL
    nxt = torch.tensor(ids[1:])

    def run(splits):
        cache, rows, start = new_cache(draft, block_size=16), [], 0
        cache.allocate("r")
        with torch.inference_mode():
            for n in splits:
                batch = cache.prepare(["r"], [n])
                rows.append(draft(nxt[start:start + n], h[start:start + n], batch, cache))
                start += n
        return torch.cat(rows)

    prefill = run([T - 1])
    assert rel_err(prefill, ref) <= TOL
    assert rel_err(draft.compute_logits(prefill), ref_logits) <= TOL
    assert rel_err(run([T - 7] + [1] * 6), ref) <= TOL
    with torch.inference_mode():
        causal = draft(nxt[None], h[None, :-1], None, None)[0]
    assert rel_err(causal, ref) <= TOL
    with torch.inference_mode():   # the hidden rows matter: pairing token i+1 with h[i+1] does not match
        shifted = draft(nxt[None], h[None, 1:], None, None)[0]
    assert rel_err(shifted, ref) > 1e-2
