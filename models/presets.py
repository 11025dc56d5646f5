"""Random-weight models of realistic shapes, built directly on the device (no checkpoint on disk).

`--random-config NAME` (target, draft, `tandem serve`, the benchmarks) stands for the model id
`random:NAME:seed=S`: a preset config below, every weight drawn on the device in the wanted dtype
from a generator seeded by (seed, the parameter's name). So target and draft, in two processes,
get the same embedding and LM head values (the draft seeds them under the target's names, as a
checkpoint shares them), every TP rank draws the full tensor and keeps its slice, and nothing of
the 31 GB of a bf16 `v2-lite` is ever materialized on the host.

Init: norms 1, router bias N(0, 0.01), every other weight N(0, 0.02): with RMSNorm before every
block this keeps activations finite through 27 layers. Random weights route tokens to experts
uniformly, which a trained model does not: bytes per step are the worst case (bench floor).

No torch at import: services/identity.py reads the configs.
"""
from __future__ import annotations

import hashlib
import json

from models.config import ModelConfig
from models.tiny import TINY_CONFIG

PREFIX = "random:"
WEIGHT_STD = 0.02
BIAS_STD = 0.01

# DeepSeek-V2-Lite's dimensions in DeepSeek-V3 form (sigmoid noaux_tc router with bias, one MTP layer):
# 15.7 B parameters (docs/DESIGN.md, "Floors"). MLA without q-LoRA.
V2_LITE = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1,
    rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0, rope_interleave=True,
    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16",
)
# V2-Lite's own YaRN (factor 40 over 4096 positions) on the same shapes.
V2_LITE_YARN = {**V2_LITE, "max_position_embeddings": 163840, "rope_scaling": {
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    "mscale": 0.707, "mscale_all_dim": 0.707}}
# DeepSeek-V3.2's own shapes (hidden 7168, MLA with 128 heads and q-LoRA 1536, 256 routed experts of 2048,
# top-8 in 8 groups, one shared expert, DSA: 64 index heads of 128, top 2048 keys) cut to 3 layers (the
# first dense) and one MTP layer: 25.5 B target parameters (51 GB in bf16), sized for one H200 with a
# 32k-token KV cache, so long-context steps are measured at the real layer shapes.
V32_SLICE = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=3, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1,
    rms_norm_eps=1e-6, max_position_embeddings=65536, rope_theta=10000.0, rope_interleave=True,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    index_n_heads=64, index_head_dim=128, index_topk=2048,
)
# DeepSeek's published fp8 format (config.json's quantization_config): e4m3 weights, a scale per 128x128 block
FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}}
V2_LITE_FP8 = {**V2_LITE, **FP8}    # the same weights as v2-lite (same seed), kept in fp8
# DeepSeek-V3's own shapes in its published fp8 format (hidden 7168, MLA with 128 heads, q-LoRA 1536, kv-LoRA
# 512; 256 routed experts of 2048, top-8 in 8 groups, one shared expert) cut to 4 layers (the first dense) and
# one MTP layer: 39 GB target + 15 GB draft in fp8 on one H200, so a decode step runs the real layer shapes.
V3_SLICE_FP8 = {**V32_SLICE, **FP8, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "num_hidden_layers": 4, "max_position_embeddings": 16384, "index_n_heads": None,
                "index_head_dim": None, "index_topk": None}
TINY = TINY_CONFIG             # CPU tests: models/tiny.py's shapes (dense first layer, 8 experts, q-LoRA, MTP)
# the same with DSA: 8 index heads of 32, top 16 keys (selection matters from the 17th token on)
TINY_V32 = {**TINY_CONFIG, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
            "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16}
PRESETS: dict[str, dict] = {"v2-lite": V2_LITE, "v2-lite-yarn": V2_LITE_YARN, "v32-slice": V32_SLICE,
                            "v2-lite-fp8": V2_LITE_FP8, "v3-slice-fp8": V3_SLICE_FP8,
                            "tiny": TINY, "tiny-v32": TINY_V32}


class PresetError(ValueError):
    """An unknown preset name or a malformed random model id."""


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise PresetError(f"--random-config: unknown preset {name!r}, expected one of {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name])


def random_model_id(name: str, seed: int) -> str:
    """The model string a random model travels as (ServiceConfig.model, GetInfo's `model`)."""
    preset_config(name)
    return f"{PREFIX}{name}:seed={seed}"


def parse_random_id(model: str) -> tuple[str, int] | None:
    """'random:NAME:seed=S' -> (NAME, S); any other string (a checkpoint directory) -> None."""
    if not model.startswith(PREFIX):
        return None
    name, _, seed = model[len(PREFIX):].partition(":seed=")
    if not seed.lstrip("-").isdigit():
        raise PresetError(f"random model id {model!r}: expected {PREFIX}NAME:seed=INT")
    preset_config(name)
    return name, int(seed)


def random_identity(model: str) -> str:
    """Model identity of a random model: sha256 of the preset's config, its name and the seed."""
    name, seed = parse_random_id(model)
    h = hashlib.sha256(json.dumps(PRESETS[name], sort_keys=True, separators=(",", ":")).encode())
    h.update(f"\n{PREFIX}{name}\nseed {seed}\ninit normal({WEIGHT_STD}) bias({BIAS_STD})".encode())
    return "sha256:" + h.hexdigest()[:16]


def _param_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{key}".encode()).digest()[:8], "little") >> 1


def init_random_on_device_(model, seed: int):
    """Fill every parameter in place, on its own device and dtype, seeded by (seed, name). An fp8 weight draws
    the values its unquantized twin would (in the embedding's dtype) and keeps their 128x128-block quantization."""
    import torch
    from kernels.fp8 import FP8, quantize_weight
    from models.loader import _shard_index
    from models.model import DraftModel
    shared = {"embed_tokens.weight": "model.embed_tokens.weight"} if isinstance(model, DraftModel) else {}
    params = dict(model.named_parameters())
    wide = next(p.dtype for p in params.values() if p.dtype != FP8)
    gens: dict = {}
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith("weight_scale_inv"):                   # set with its weight
                continue
            g = gens.setdefault(p.device, torch.Generator(device=p.device))
            g.manual_seed(_param_seed(seed, shared.get(name, name)))
            std = BIAS_STD if name.endswith("e_score_correction_bias") else WEIGHT_STD
            full, shard = tuple(getattr(p, "full_shape", p.shape)), getattr(p, "shard", None)
            if p.dtype == FP8:
                q, s = quantize_weight(torch.empty(full, dtype=wide, device=p.device).normal_(0.0, std, generator=g))
                scale = params[name + "_scale_inv"]
                p.copy_(q[_shard_index(shard, full)])
                scale.copy_(s[_shard_index(scale.shard, scale.full_shape)])
            elif shard is None and tuple(p.shape) == full:
                p.normal_(0.0, std, generator=g)
            else:                            # a TP slice: draw the full tensor, keep this rank's part
                t = torch.empty(full, dtype=p.dtype, device=p.device).normal_(0.0, std, generator=g)
                p.copy_(t[_shard_index(shard, full)])
    return model


def build_random(cls, model: str, ps=None, dtype=None, device="cpu", quantization: str = "auto"):
    """cls (TargetModel | DraftModel) of the random model id, built and initialized on `device`."""
    import torch
    from models.loader import build
    from models.parallel import SINGLE
    name, seed = parse_random_id(model)
    m = build(cls, preset_config(name).quantized(quantization, device), ps or SINGLE, dtype or torch.float32, device)
    return init_random_on_device_(m, seed)


def load_any(cls, model: str, ps=None, dtype=None, device="cpu", quantization: str = "auto"):
    """A checkpoint directory (models/loader.py) or a random model id (this file); quantization:
    models/config.QUANTIZATIONS (auto: the checkpoint's or preset's own format)."""
    import torch
    from models.loader import load_model
    from models.parallel import SINGLE
    if parse_random_id(model) is not None:
        return build_random(cls, model, ps, dtype, device, quantization)
    return load_model(cls, model, ps=ps or SINGLE, dtype=dtype or torch.float32, device=device,
                      quantization=quantization)


def model_config(model: str) -> ModelConfig:
    """The ModelConfig of a checkpoint directory or a random model id."""
    parsed = parse_random_id(model)
    return preset_config(parsed[0]) if parsed else ModelConfig.from_file(model)
