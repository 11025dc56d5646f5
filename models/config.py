"""ModelConfig: the DeepSeek-V3-family fields Tandem reads from a HF `config.json`, validated once."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path


class ConfigError(ValueError):
    """A config.json field is missing, has the wrong type, or contradicts another field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    # DeepSeek's YaRN magnitude correction: 0.1 * m * ln(s) + 1 for s > 1.
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


V32_INDEXER_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
# How the linear layers hold their weights (--quantization): none = the serving dtype; fp8 = DeepSeek's e4m3
# with a scale per 128x128 block (kernels/fp8.py); auto = the checkpoint's own (config.json quantization_config),
# dequantized on a CPU
QUANTIZATIONS = ("auto", "none", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0  # 0: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "bfloat16"
    # DeepSeek-V3.2 sparse attention (DSA): the lightning indexer of every layer (models/indexer.py)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    # "fp8": MLA projections (q_a, q_b / q, kv_a, o), dense MLPs, shared and routed experts hold fp8 weights and
    # 128x128 block scales (kernels/fp8.py); norms, router, kv_b (absorbed into the attention core), the
    # indexer, embedding and LM head keep the serving dtype. "none": every weight in the serving dtype.
    quantization: str = "none"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek-V3.2: each query attends only the index_topk keys its layer's indexer selects."""
        return self.index_topk is not None

    def quantized(self, quantization: str, device: str = "") -> "ModelConfig":
        """This config with --quantization applied. auto: the checkpoint's own format, except that on a CPU `device`
        an fp8 checkpoint is dequantized (the reference path: its fp8 linears cost ~3x a wide matmul there); an
        explicit fp8 keeps fp8 on any device."""
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {'|'.join(QUANTIZATIONS)}, got {quantization!r}")
        if quantization == "auto":
            return replace(self, quantization="none") if str(device).startswith("cpu") else self
        return replace(self, quantization=quantization)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)} - {"rope", "eos_token_ids", "quantization"}
        kw = {k: raw[k] for k in known if k in raw and raw[k] is not None}
        if "n_routed_experts" not in raw and "num_local_experts" in raw:
            kw["n_routed_experts"] = raw["num_local_experts"]
        if "num_nextn_predict_layers" not in raw and "num_mtp_layers" in raw:
            kw["num_nextn_predict_layers"] = raw["num_mtp_layers"]
        for k in ("n_group", "topk_group", "moe_layer_freq"):
            kw.setdefault(k, 1)
        if kw.get("n_routed_experts"):
            kw.setdefault("num_experts_per_tok", 1)
        if raw.get("model_type") == "deepseek_v32" or "DeepseekV32ForCausalLM" in (raw.get("architectures") or []):
            for k, v in V32_INDEXER_DEFAULTS.items():        # transformers' DeepseekV32Config defaults
                kw.setdefault(k, v)
        eos = raw.get("eos_token_id", 1)
        kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        kw["rope"] = _rope_from_dict(raw)
        kw["quantization"] = _quantization_from_dict(raw)
        try:
            cfg = cls(**kw)
        except TypeError as e:
            raise ConfigError(f"config.json: {e}") from None
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    def validate(self) -> None:
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(f"config.json: {msg}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 for a MoE model")
            need(0 < self.num_experts_per_tok <= self.n_routed_experts,
                 f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                 f"got {self.num_experts_per_tok}")
            need(self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
            need(1 <= self.topk_group <= self.n_group,
                 f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.n_routed_experts // self.n_group
            need(self.num_experts_per_tok <= self.topk_group * per_group,   # else top-k picks masked experts
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= topk_group ({self.topk_group}) "
                 f"* experts per group ({per_group})")
            need(self.scoring_func in ("sigmoid", "softmax"),
                 f"scoring_func must be 'sigmoid' or 'softmax', got {self.scoring_func!r}")
            need(self.topk_method in ("noaux_tc", "greedy", "group_limited_greedy"),
                 f"topk_method {self.topk_method!r} is not supported")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0")
        need(self.rope.kind in ("default", "yarn"), f"rope type {self.rope.kind!r} is not supported")
        index = (self.index_n_heads, self.index_head_dim, self.index_topk)
        need(all(v is None for v in index) or all(isinstance(v, int) and v > 0 for v in index),
             f"index_n_heads, index_head_dim and index_topk must all be set (positive) or all absent, got {index}")
        if self.sparse_attention:
            need(bool(self.q_lora_rank), "a sparse-attention (V3.2) model needs q_lora_rank: its indexer reads "
                                         "the attention's q_a_layernorm(q_a_proj(x))")
            need(self.qk_rope_head_dim <= self.index_head_dim,
                 f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be <= index_head_dim ({self.index_head_dim})")


def _quantization_from_dict(raw: dict) -> str:
    """'fp8' for DeepSeek's published fp8 checkpoints (quant_method fp8, e4m3, 128x128 blocks), else 'none'."""
    q = raw.get("quantization_config") or {}
    if not q:
        return "none"
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), list(q.get("weight_block_size") or [128, 128])
    if method != "fp8" or fmt != "e4m3" or block != [128, 128]:
        raise ConfigError(f"config.json: quantization_config {q} is not supported; expected quant_method fp8, "
                          "fmt e4m3, weight_block_size [128, 128] (DeepSeek's)")
    return "fp8"


def _rope_from_dict(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if kind != "yarn":
        return RopeConfig(theta=float(theta), kind=kind)
    return RopeConfig(
        theta=float(theta), kind="yarn", factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        raw.get("max_position_embeddings", 4096))),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)))
