"""A tiny DeepSeek-V3.2 checkpoint written by transformers' DeepseekV32ForCausalLM (DeepSeek's per-expert
layout), with an MTP layer (its own indexer included) added the way DeepSeek ships it, at
`model.layers.{num_hidden_layers}`. index_topk is 8, so the indexer's selection matters from the ninth
token on. A helper of the V3.2 tests, not a test file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

V32_HF = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    index_n_heads=8, index_head_dim=32, index_topk=8,
)


def hf_v32_model(seed: int = 0, **overrides):
    """A randomized transformers DeepseekV32ForCausalLM in fp32, eval mode (weights N(0, 0.05), norms ~1)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from conftest import randomize_
    cfg = DeepseekV32Config(**{**V32_HF, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return randomize_(DeepseekV32ForCausalLM(cfg).float().eval(), seed)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each step a full forward over the whole sequence (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def make_v32_checkpoint(path: str | Path, seed: int = 0, **overrides):
    """Write the checkpoint (+ MTP layer, tokenizer) to `path`; -> (path, the transformers model)."""
    from models.config import ModelConfig
    from models.loader import build, checkpoint_tensors
    from models.model import DraftModel
    from models.tiny import _sample_texts, init_random_, train_tokenizer
    path = Path(path)
    hf = hf_v32_model(seed, **overrides)
    hf.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    draft = init_random_(build(DraftModel, ModelConfig.from_dict(raw)), seed + 1, 0.05)
    with torch.no_grad():              # the MTP layer shares embedding and head, as DeepSeek ships them
        draft.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(hf.lm_head.weight)
        layer = draft.mtp[0]           # pass the token embedding through, so that drafts are accepted at times
        d = raw["hidden_size"]
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(d), 0.3 * layer.eh_proj.weight[:, d:]], 1))
        layer.self_attn.o_proj.weight.mul_(0.5)
    L = raw["num_hidden_layers"]
    mtp = {n: t for n, t in checkpoint_tensors(draft).items() if n.startswith(f"model.layers.{L}.")}
    assert any(".self_attn.indexer.wq_b." in n for n in mtp), sorted(mtp)
    save_file({n: t.contiguous() for n, t in mtp.items()}, str(path / "model-mtp.safetensors"))
    train_tokenizer(_sample_texts(), raw["vocab_size"], path)
    return path, hf
