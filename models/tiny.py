"""Small random checkpoints in the exact HF layout Tandem serves (`tandem make-tiny`), seeded."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from models.config import ModelConfig
from models.loader import build, checkpoint_tensors, save_checkpoint
from models.model import DraftModel, TargetModel

TINY_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1,
    rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, rope_interleave=True,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)


def init_random_(model: torch.nn.Module, seed: int, std: float = 0.02) -> torch.nn.Module:
    """Norms to one, router bias small, everything else N(0, std); same names -> same values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


# Pre-tokens for code, tried in this order at each position: one line break alone (so no token spans a
# line boundary: the tokens of a prompt cut after "\n" are a prefix of the tokens of prompt + continuation);
# a word (letters, digits, "_") with at most one space or punctuation character before it; up to three
# digits with an optional space; a run of punctuation with an optional space; a run of spaces/tabs that ends
# before a non-space is given all but its last character (indentation, its last space joins the next word);
# other runs of spaces/tabs. No pattern matches "\n" except the first, and the only look-ahead, (?!\S), sees
# the "\n" itself at a line's end, so nothing after a line break changes the pre-tokens before it.
CODE_SPLIT = (r"\n|(?: |[^\s\p{L}\p{N}_])?[\p{L}_][\p{L}\p{N}_]*| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}_]+"
              r"|[^\S\n]+(?!\S)|[^\S\n]+")


def code_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CODE_SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_tokenizer(texts, vocab_size: int, path: Path, pre_tokenizer=None) -> None:
    """Byte-level BPE over code pre-tokens (CODE_SPLIT, unless another pre_tokenizer is given) with <s>,
    </s>, <pad> as ids 1, 2, 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or code_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    }, indent=1))


def _sample_texts() -> list[str]:
    # the Python standard library's own sources: on every machine, no download
    import os
    root = Path(os.__file__).parent
    return [p.read_text(errors="ignore") for p in sorted(root.glob("*.py"))[:40]]


def default_model() -> Path:
    """The bundled trained model when present, else the seeded random tiny model, made here once."""
    from infra.paths import default_model_dir
    path = default_model_dir()
    if not (path / "config.json").exists():
        make_tiny(path)
    return path


def make_tiny(out_dir: str | Path, seed: int = 0, overrides: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **(overrides or {})}
    cfg = ModelConfig.from_dict(raw)
    target = init_random_(build(TargetModel, cfg), seed)
    draft = init_random_(build(DraftModel, cfg), seed + 1)
    with torch.no_grad():  # the MTP layer shares the target's embedding and head, as DeepSeek ships them
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    save_checkpoint(checkpoint_tensors(target, draft), out)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], "do_sample": False}, indent=1))
    train_tokenizer(_sample_texts(), raw["vocab_size"], out)
    return out
