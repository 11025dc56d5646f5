"""fp8 serving on CPU (issue 15): DeepSeek's fp8 checkpoints load as fp8 (no wider copy of their weights), a
wider checkpoint or preset quantizes at load (--quantization fp8), the MTP draft has its own switch, and a
served fp8 target with K = 3 speculation gives exactly its own greedy output. CPU runs the reference path
(kernels/fp8.py); the Triton kernels are checked in tests/test_fp8_kernels.py.
"""
import json
import re

import pytest
import torch

from cluster import Cluster, make_checkpoint
from kernels import fp8
from models.config import ConfigError, ModelConfig
from models.loader import Checkpoint, load_model, save_checkpoint
from models.model import DraftModel, TargetModel
from models.presets import build_random, preset_config
from models.runner import greedy_generate
from tandem.v1 import generate_pb2 as gen

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_KEPT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8-ckpt") / "tiny", seed=3)


def fp8_params(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]


def test_quantized_preset_keeps_the_projections_in_fp8_and_the_rest_wide():
    bf = build_random(TargetModel, "random:tiny:seed=0")
    q = build_random(TargetModel, "random:tiny:seed=0", quantization="fp8")
    names = fp8_params(q)
    assert names and all(any(k in n for k in FP8_KEPT) for n in names)
    assert {n.split(".")[-2] for n in names} == set(FP8_KEPT)                # every kind, nothing else
    params = dict(q.named_parameters())
    for n in names:                                 # the same weights as the wide preset, quantized in blocks
        w, s = fp8.quantize_weight(dict(bf.named_parameters())[n])
        assert torch.equal(params[n].view(torch.uint8), w.view(torch.uint8)) and torch.equal(params[n + "_scale_inv"], s)
    assert q.lm_head.weight.dtype == q.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert preset_config("v2-lite-fp8").quantization == "fp8" and preset_config("v2-lite").quantization == "none"
    v3 = preset_config("v3-slice-fp8")
    assert (v3.hidden_size, v3.num_attention_heads, v3.q_lora_rank, v3.kv_lora_rank, v3.n_routed_experts,
            v3.moe_intermediate_size, v3.num_experts_per_tok, v3.n_shared_experts) == (7168, 128, 1536, 512, 256,
                                                                                       2048, 8, 1)


def write_fp8_checkpoint(src, dst):
    """src's checkpoint as DeepSeek publishes V3: every 2-D weight but norms/router/embedding/head in fp8 with
    weight_scale_inv (kv_b_proj too), and quantization_config in config.json."""
    ck = Checkpoint(src)
    tensors = {}
    for name in ck.files:
        t = ck.read(name)
        if t.dim() == 2 and (any(k in name for k in FP8_KEPT) or "kv_b_proj" in name or "eh_proj" in name):
            tensors[name], tensors[name + "_scale_inv"] = fp8.quantize_weight(t)
        else:
            tensors[name] = t
    save_checkpoint(tensors, dst)
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}))
    return tensors


def test_fp8_checkpoint_loads_as_stored_and_never_wider(ckpt, tmp_path, monkeypatch):
    tensors = write_fp8_checkpoint(ckpt, tmp_path)
    assert ModelConfig.from_file(tmp_path).quantization == "fp8"
    reads = []
    read = Checkpoint.read

    def spy(self, name, index=None, raw=False):
        reads.append((name, raw))
        return read(self, name, index, raw)
    monkeypatch.setattr(Checkpoint, "read", spy)
    m = load_model(TargetModel, tmp_path, quantization="fp8")              # as stored (auto on a GPU)
    params = dict(m.named_parameters())
    for n in fp8_params(m):
        assert torch.equal(params[n].view(torch.uint8), tensors[n].view(torch.uint8)), n
        assert torch.equal(params[n + "_scale_inv"], tensors[n + "_scale_inv"]), n
    widened = {n for n, raw in reads if not raw and tensors[n].dtype == torch.float8_e4m3fn}
    assert widened and all("kv_b_proj" in n for n in widened), widened     # only kv_b (absorbed, kept wide)
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(params[kv_b], fp8.dequantize_weight(tensors[kv_b], tensors[kv_b + "_scale_inv"]))
    wide = load_model(TargetModel, tmp_path, quantization="none")           # dequantized at load, as before
    assert not fp8_params(wide)
    assert greedy_generate(m, [5, 6, 7], 6) == greedy_generate(m, [5, 6, 7], 6)
    auto = load_model(TargetModel, tmp_path)                # auto on a CPU: dequantized, the reference path
    a, w = auto.state_dict(), wide.state_dict()
    assert not fp8_params(auto) and a.keys() == w.keys() and all(torch.equal(a[n], w[n]) for n in w)
    draft = load_model(DraftModel, tmp_path, quantization="fp8")
    assert fp8_params(draft) and draft.mtp[0].eh_proj.weight.dtype == torch.float32


def test_bad_quantization_is_refused_naming_the_flag(ckpt, tmp_path, capsys):
    from services.config import parse
    with pytest.raises(SystemExit, match=r"--quantization must be one of auto\|none\|fp8, got 'int4'"):
        parse("target", ["--random-config", "tiny", "--quantization", "int4"], "t")
    from tandem.serve import parse as serve_parse
    with pytest.raises(SystemExit):
        serve_parse(["--random-config", "tiny", "--draft-quantization", "fp4"])
    assert "--draft-quantization: invalid choice: 'fp4'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=re.escape("--quantization must be one of auto|none|fp8, got 'bf16'")):
        preset_config("tiny").quantized("bf16")
    raw = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ConfigError, match="weight_block_size"):
        ModelConfig.from_dict({**raw, "quantization_config": {**FP8_CONFIG, "weight_block_size": [64, 64]}})


def test_serve_gives_target_and_draft_their_own_quantization():
    from tandem.serve import commands, parse
    cmds = {name: cmd for name, cmd, _ in commands(parse(["--random-config", "tiny", "--quantization", "fp8",
                                                           "--draft-quantization", "none"]))}
    at = lambda cmd: cmd[cmd.index("--quantization") + 1]
    assert at(cmds["target"]) == "fp8" and at(cmds["draft"]) == "none" and "--quantization" not in cmds["gateway"]
    cmds = {name: cmd for name, cmd, _ in commands(parse(["--random-config", "tiny", "--quantization", "fp8"]))}
    assert at(cmds["draft"]) == "fp8"                                     # default: the target's


def test_served_fp8_target_speculation_equals_its_plain_decoding(ckpt, tmp_path):
    """`--quantization fp8` in target and draft: K = 3 gives exactly K = 0's tokens, which are the fp8 target's
    own greedy tokens (not the fp32 model's: fp8 really served)."""
    ref8 = load_model(TargetModel, ckpt, quantization="fp8")
    ref32 = load_model(TargetModel, ckpt)
    prompts = [[(11 * i + 5 * j) % 500 + 3 for j in range(3 + 4 * i)] for i in range(4)]
    want = [greedy_generate(ref8, p, 16) for p in prompts]
    assert any(w != greedy_generate(ref32, p, 16) for w, p in zip(want, prompts))
    accepted = 0
    with Cluster(ckpt, k=3, gateways=[{"hidden_transport": "gloo"}], log_dir=tmp_path,
                 extra_service_args=["--quantization", "fp8"]) as c:
        stub = c.gateways[0].stub
        for p, w in zip(prompts, want):
            outs = {}
            for k in (0, 3):
                req = gen.GenerateRequest(max_tokens=16, ignore_eos=True, num_speculative_tokens=k)
                req.token_ids.ids.extend(p)
                r = stub.Generate(req, timeout=120)
                outs[k] = list(r.token_ids)
                accepted += r.spec_stats.num_accepted_tokens
            assert outs[0] == outs[3] == w, (p, outs, w)
    assert accepted > 0


def test_the_roofline_counts_the_bytes_each_device_holds():
    """`auto` keeps an fp8 preset fp8 on a GPU and dequantizes it on a CPU: the byte floor follows."""
    from tandem.roofline import round_floor_ms
    def floor(device, quantization="auto"):
        return round_floor_ms("random:v2-lite-fp8:seed=0", torch.bfloat16, 1, 0, 64, 1e12, quantization,
                              device=device)["verify_floor_ms"]
    assert floor("cpu") > 1.5 * floor("cuda:0") and floor("cuda:0", "none") == floor("cpu")
