"""Shared helpers for the model-core tests: tiny randomized transformers DeepSeek-V3 models, checkpoint
writers, our own tiny models, and the error metric every parity check uses.

Test files import these directly (`from conftest import ...`); pytest puts tests/ on sys.path.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.loader import build
from models.model import TargetModel
from models.runner import forward_tokens, new_cache
from models.tiny import TINY_CONFIG, init_random_

from api_cluster import api_cluster  # noqa: F401,E402  (session fixture: the API tests' shared cluster)
from fuzz_cluster import fuzz_cluster  # noqa: F401,E402  (session fixture: the hostile-input tests' cluster)

__all__ = ["api_cluster", "fuzz_cluster"]    # fixtures re-exported for pytest

# Tiny tensors: one thread is fastest, and avoids OpenMP spin-wait collapse on a busy 2-core box
# (seen: 0.2 s -> 30 s for test_kv_cache.py). Also keeps reductions in one fixed order.
torch.set_num_threads(1)

# A tiny DeepSeek-V3 in transformers' terms: layer 0 dense, layers 1.. MoE; vocab > 128 so that fp8's
# 128x128 blocks split the embedding and the LM head.
HF_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_interleave=True, num_mtp_layers=0,
    tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|."""
    ours, ref = ours.detach().float(), ref.detach().float()
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.05, bias_std: float = 0.0):
    """Visible random weights: N(0, std) matrices, norms 1 + N(0, 0.1), router bias N(0, bias_std)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_std * torch.randn(b.shape, generator=g))
    return module


def hf_config(**overrides):
    from transformers import DeepseekV3Config
    cfg = DeepseekV3Config(**{**HF_BASE, **overrides})
    cfg._attn_implementation = "sdpa"   # a None mask means causal (MtpLayer relies on it)
    return cfg


def hf_model(seed: int = 0, bias_std: float = 0.0, **overrides):
    """A randomized transformers DeepseekV3ForCausalLM in fp32, eval mode."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(**overrides)).float().eval()
    return randomize_(model, seed, bias_std=bias_std)


def save_hf(model, path: Path, layout: str) -> Path:
    """'per_expert': model.save_pretrained (DeepSeek's `experts.{e}.gate_proj.weight`);
    'fused': the state dict transformers keeps in memory (`experts.gate_up_proj` [E, 2I, H])."""
    path = Path(path)
    if layout == "per_expert":
        model.save_pretrained(path)
    elif layout == "fused":
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
        model.config.save_pretrained(path)
    else:
        raise ValueError(layout)
    return path


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], raw_config: dict) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw_config, indent=1))
    return path


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def tiny_model(cls=TargetModel, seed: int = 0, std: float = 0.05, **overrides):
    """Our model, built directly (no checkpoint) from TINY_CONFIG + overrides, seeded."""
    return init_random_(build(cls, ModelConfig.from_dict({**TINY_CONFIG, **overrides})), seed, std)


def prefill_then_decode(model, ids: list[int], prefill: int, block_size: int = 16, request_id: str = "r"):
    """Final-norm hidden [len(ids), D]: ids[:prefill] in one step, then one token per step."""
    cache = new_cache(model, block_size=block_size)
    rows = [forward_tokens(model, cache, {request_id: ids[:prefill]})]
    rows += [forward_tokens(model, cache, {request_id: [t]}) for t in ids[prefill:]]
    return torch.cat(rows)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


# --- leaving the test process -------------------------------------------------------------------------
# A background thread blocked in a C++ call (a bridge channel's store client retrying a connect for up to its
# timeout, a channel a test left to a peer it killed) that returns while the interpreter finalizes is ended
# by pthread_exit through C++ frames: "terminate called without an active exception", exit code 134 after
# every test passed. So once pytest is done, the exit handlers run and the process leaves without
# finalizing the interpreter, with pytest's own exit status.
_EXIT = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _EXIT["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if "status" in _EXIT and not hasattr(config, "workerinput"):
        import atexit
        import os
        import sys
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])
