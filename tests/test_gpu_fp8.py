"""fp8 on the GPU (issue 15): `tandem serve --device cuda --quantization fp8` keeps greedy K = 1..3 equal to K = 0
(lossless within the fp8 target: its fp8 GEMMs give a row the same bits in a 1-row decode step and a 4-row
verify step), and an fp8 checkpoint loads without a wider copy on the device. Skipped without CUDA."""
import json

import pytest
import torch

from gpu_cluster import serve_cuda
from tandem.v1 import generate_pb2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")


def test_cuda_fp8_speculation_equals_plain_decoding(tmp_path):
    accepted = 0
    with serve_cuda(tmp_path, ["--quantization", "fp8"]) as (gateway, _, _, log):
        for i in range(8):
            prompt = [(13 * i + 7 * j) % 500 + 3 for j in range(2 + 3 * i)]
            outs = {}
            for k in (0, 1, 3):
                r = gateway.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                     max_tokens=24, ignore_eos=True, num_speculative_tokens=k), timeout=120)
                outs[k] = list(r.token_ids)
                accepted += r.spec_stats.num_accepted_tokens
            assert outs[1] == outs[0] and outs[3] == outs[0], (i, outs)
    assert accepted > 0


def test_cuda_fp8_checkpoint_load_peak_is_the_fp8_weights(tmp_path):
    """V2-Lite's shapes, 2 layers, written as DeepSeek publishes fp8; loaded on the GPU its peak memory stays
    within 2 % (+ 64 MB) of the fp8 weights it holds: no bf16 copy of a weight is ever made there."""
    from models.config import ModelConfig
    from models.loader import build, checkpoint_tensors, load_model, save_checkpoint
    from models.model import TargetModel
    from models.presets import PRESETS, init_random_on_device_
    raw = {**PRESETS["v2-lite-fp8"], "num_hidden_layers": 2}
    m = init_random_on_device_(build(TargetModel, ModelConfig.from_dict(raw), dtype=torch.bfloat16, device="cuda"), 0)
    save_checkpoint(checkpoint_tensors(m), tmp_path, max_shard_bytes=1 << 30)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    del m
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    m = load_model(TargetModel, tmp_path, dtype=torch.bfloat16, device="cuda")
    held = sum(p.numel() * p.element_size() for p in m.parameters())
    peak = torch.cuda.max_memory_allocated() - base
    fp8 = sum(p.numel() for p in m.parameters() if p.dtype == torch.float8_e4m3fn)
    assert fp8 > held / 3                                   # the experts and projections: fp8 bytes
    assert peak <= 1.02 * held + (64 << 20), (peak, held)
