"""`tandem train` on a few stdlib files with a tiny shape, end to end on CPU: the split, the code tokenizer, the
held-out windows (every token after the first scored once), bits per byte, the export (shards within 16 MiB
with their header, loadable by the serving loader), and `tandem bench heldout` agreeing with the training log;
edition 2's recipe: --extra training-only files and the stdlib's weight, the chained MTP depths' alignment, the
depth-scaled init, and the schedule's clock starting after the compiling step."""
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from models.config import ModelConfig
from models.loader import Checkpoint, load_model
from models.model import DraftModel, TargetModel
from models.tiny import CODE_SPLIT
from tandem import bench_heldout, train, train_model
from tandem.train_model import build_models

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32,
            kv_lora_rank=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=1024)


def test_held_windows_score_every_token_once():
    for n, T in ((1000, 64), (1025, 1024), (4097, 1024), (130, 64)):
        wins = train.held_windows(torch.arange(n), T, 0)
        predicted = torch.cat([w[1:] for w in wins]).tolist()
        last = n - 1 if (n - 1) % T == 1 else n          # a tail of one predicted token is left out
        assert predicted == list(range(1, last)), (n, T)
        assert all(len(w) == T + 1 for w in wins[:-1])
    assert len(train.held_windows(torch.arange(1000), 64, 4)) == 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train")
    (out / "extra" / "pkg").mkdir(parents=True)
    for i in range(2):                                  # training-only code, never held out
        (out / "extra" / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    args = [f"--arch={k}={v}" for k, v in TINY.items()] + [
        "--max-files", "24", "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--max-steps", "4",
        "--eval-every", "2", "--eval-seqs", "4", "--warmup-steps", "2", "--max-minutes", "5", "--reserve-s", "1",
        "--out", str(out / "ck"), "--work-dir", str(out / "work"), "--device", "cpu", "--edition", "2",
        "--extra", str(out / "extra"), "--chain-rows", "1"]
    assert train.main(args) == 0
    return out / "ck"


def tiny_models(depth_init: bool = True):
    c = train.parse(["--edition", "2", "--device", "cpu"] + [f"--arch={k}={v}" for k, v in TINY.items()])
    c.depth_init = depth_init
    return build_models(ModelConfig.from_dict(train.model_config(c)), c)[:2]


def test_chained_mtp_depths_line_up():
    """Depth d at position t reads tokens 0..t+d (the target's hidden at t, then the MTP's own output, and the
    embeddings of tokens t+1..t+d) and predicts token t+d+1: changing token t+d+1 leaves its logits alone,
    changing token t+d does not; the chained depths see only the first chain_rows sequences."""
    target, draft = tiny_models()
    chunk, t = torch.randint(3, 1024, (2, 17), generator=torch.Generator().manual_seed(0)), 5
    with torch.no_grad():
        main, ces, _, mlogits = train_model.forward_losses(target, draft, chunk, 3, 1)
        assert [tuple(m.shape) for m in mlogits] == [(2, 15, 1024), (1, 14, 1024), (1, 13, 1024)] and len(ces) == 3
        for d, (ce, ml) in enumerate(zip(ces, mlogits), start=1):     # scored against token t+d+1
            assert torch.allclose(ce, F.cross_entropy(ml.flatten(0, 1), chunk[: ml.shape[0], d + 1:].flatten()))
        for d in (1, 2, 3):
            later, last = chunk.clone(), chunk.clone()
            later[:, t + d + 1] = (later[:, t + d + 1] + 1) % 1024
            last[:, t + d] = (last[:, t + d] + 1) % 1024
            same = train_model.forward_losses(target, draft, later, 3, 1)[3][d - 1][:, t]
            other = train_model.forward_losses(target, draft, last, 3, 1)[3][d - 1][:, t]
            assert torch.equal(same, mlogits[d - 1][:, t]) and not torch.allclose(other, mlogits[d - 1][:, t])


@pytest.mark.parametrize("starve", [False, True])
def test_grouped_experts_are_the_dense_experts(starve):
    """--moe grouped (each token's top-k rows sorted into expert groups padded to ALIGN rows, two grouped GEMMs) is
    the dense reference's function: the same output, gradients (input, router, every expert's weights) and expert
    loads, also with an expert that no token picks (an empty group)."""
    target = tiny_models()[0]
    moe = next(m for m in target.modules() if isinstance(m, train_model.MoE))
    if starve:
        moe.gate.e_score_correction_bias[0] = -1e3                # noaux_tc: expert 0 is never chosen
    x = torch.randn(3, 37, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    got = {}
    for name, forward in train_model.MOE_FORWARD.items():
        moe.expert_load.zero_(), moe.zero_grad()
        xi = x.clone().requires_grad_()
        y = forward.__get__(moe)(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        got[name] = dict(y=y.detach(), dx=xi.grad, load=moe.expert_load.clone(),
                         **{n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
    dense, grouped = got["dense"], got["grouped"]
    assert dense.keys() == grouped.keys() and "gate.weight" in dense and "experts.7.down_proj.weight" in dense
    assert bool((dense["load"] == 0).any()) == starve and dense["load"].sum() == 3 * 37 * moe.gate.spec.top_k
    for k, v in dense.items():
        torch.testing.assert_close(grouped[k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert grouped["y"].abs().max() > 1e-3 and grouped["experts.3.gate_proj.weight"].abs().max() > 0


def test_depth_init_scales_the_residual_outputs():
    scaled, plain = tiny_models(True)[0], tiny_models(False)[0]
    L = TINY["num_hidden_layers"]
    for name, p in scaled.named_parameters():
        q = dict(plain.named_parameters())[name]
        factor = (2 * (L + 1)) ** -0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        assert torch.allclose(p, q * factor), name


def test_schedule_time_starts_after_the_compiling_step():
    c = train.parse([])
    assert train.schedule_progress(dict(step=1, train_s=50.0, budget_s=350.0), c) == pytest.approx(50 / 350)
    assert train.schedule_progress(dict(step=9, train_s=200.0, budget_s=350.0, first_s=50.0), c) == 0.5
    # a --resume call compiles again: its first step is not on the clock either
    assert train.schedule_progress(dict(step=9, train_s=260.0, budget_s=350.0, first_s=50.0, recompile_s=60.0), c) == 0.5
    c.max_steps = 10
    assert train.schedule_progress(dict(step=9, train_s=200.0, budget_s=350.0, first_s=50.0), c) == 0.9


def test_editions():
    """--edition 2 (the default) is the bundled model's shape and schedule; 1 the first, 5-layer one; flags win."""
    one, two = train.parse(["--edition", "1"]), train.parse(["--lr", "1e-3"])
    assert one.arch == train.ARCH_1 and (one.lr, one.max_steps, one.eval_every, one.mtp_depths) == (2e-3, 0, 500, 1)
    assert (one.corpus_repeat, one.depth_init, one.train_minutes, one.extra) == (1, False, 0.0, "")
    assert two.arch == train.ARCH and (two.lr, two.mtp_depths, two.corpus_repeat, two.train_minutes) == (1e-3, 3, 2, 6.55)
    assert json.loads((Path(__file__).parents[1] / "checkpoints/tandem-code-mini/config.json").read_text())[
        "num_hidden_layers"] == two.arch["num_hidden_layers"] == train.TrainConfig().arch["num_hidden_layers"]
    three = train.parse(["--edition", "3"])                 # not shipped: deeper, grouped experts, fp8 export
    assert (one.moe, two.moe, three.moe, three.export_fp8, three.arch["num_hidden_layers"]) == (
        "dense", "dense", "grouped", True, 40)
    with pytest.raises(SystemExit):                          # compiled grouped GEMMs are bf16 (CUDA)
        train.parse(["--edition", "3", "--compile", "true", "--device", "cpu"])


def test_train_exports_a_servable_checkpoint(trained):
    log = json.loads((trained / "train_log.json").read_text())
    held = json.loads((trained / "heldout_files.json").read_text())
    assert (held["n_train_files"], held["n_heldout_files"]) == (23, 1) and log["steps"] == 4
    corpus = log["corpus"]                  # edition 2: the stdlib training files twice, then the extra files
    assert (corpus["extra_files"], corpus["corpus_repeat"]) == (2, 2) and corpus["extra_tokens"] > 0
    assert corpus["train_tokens"] == 2 * corpus["stdlib_train_tokens"] + corpus["extra_tokens"]
    assert 0 <= log["heldout_mtp2_acc"] <= 1 and 0 <= log["heldout_mtp3_acc"] <= 1
    tok = Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert json.loads(tok.to_str())["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == CODE_SPLIT
    # bits per byte: the same negative log-likelihood as the loss, per byte of the scored tokens
    nb = train.token_bytes(tok)
    root = Path(os.__file__).parent
    text = (root / held["files"][0]).read_text(errors="ignore")
    ids = tok.encode(text).ids
    assert int(nb[ids].sum()) == len(text.encode())
    assert log["heldout_eval_bytes"] == len(text.encode()) - int(nb[ids[0]])
    assert log["heldout_bits_per_byte"] == pytest.approx(
        log["heldout_loss"] * log["heldout_eval_tokens"] / math.log(2) / log["heldout_eval_bytes"], rel=1e-6)
    assert all(p.stat().st_size <= 16 << 20 for p in trained.glob("*.safetensors"))
    target, draft = (load_model(cls, trained) for cls in (TargetModel, DraftModel))
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)


def test_an_fp8_export_is_the_bf16_export_as_fp8_serving_holds_it(trained, tmp_path):
    """--export-fp8 (issue 18: more parameters in the same bytes): the weights an fp8 model keeps in fp8 stored in
    DeepSeek's block format with quantization_config, the rest as the bf16 export; loaded, the checkpoint is the
    bf16 export loaded with --quantization fp8, tensor for tensor, in fewer bytes."""
    target, draft = (load_model(cls, trained) for cls in (TargetModel, DraftModel))
    cfg_raw = json.loads((trained / "config.json").read_text())
    nbytes = train_model.export(target, draft, cfg_raw, tmp_path, fp8=True)
    assert ModelConfig.from_file(tmp_path).quantization == "fp8"
    names = set(Checkpoint(tmp_path).files)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in names
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in names
    assert not {n for n in names if n.endswith("_scale_inv") and ("kv_b_proj" in n or "eh_proj" in n
                                                                      or "embed" in n or "lm_head" in n)}
    bf16_bytes = sum(p.stat().st_size for p in trained.glob("*.safetensors"))
    assert nbytes < 0.75 * bf16_bytes
    for cls in (TargetModel, DraftModel):
        got = load_model(cls, tmp_path, quantization="fp8").state_dict()      # as stored (auto on a GPU)
        want = load_model(cls, trained, quantization="fp8").state_dict()
        assert got.keys() == want.keys()
        for k, v in want.items():
            a, b = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (got[k], v))
            assert a.dtype == b.dtype and torch.equal(a, b), (cls.__name__, k)


def test_bench_heldout_matches_the_training_log(trained, tmp_path):
    assert bench_heldout.main(["--model", str(trained), "--device", "cpu", "--seq-len", "32",
                               "--out", str(tmp_path / "h.json")]) == 0
    got, log = json.loads((tmp_path / "h.json").read_text()), json.loads((trained / "train_log.json").read_text())
    assert got["eval_tokens"] == log["heldout_eval_tokens"]
    # the export is bf16, training evaluated the fp32 master weights: close, not equal
    assert got["bits_per_byte"] == pytest.approx(log["heldout_bits_per_byte"], rel=0.02)


def test_a_run_split_over_two_calls_ends_where_one_call_ends(tmp_path, capsys):
    """--stop-step ends a call mid-schedule (it says how to go on); --resume continues the same schedule, data order
    and optimizer: the last weights equal one uninterrupted call's, bit for bit."""
    args = [f"--arch={k}={v}" for k, v in TINY.items()] + [
        "--max-files", "24", "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--max-steps", "6",
        "--eval-every", "3", "--eval-seqs", "4", "--warmup-steps", "2", "--max-minutes", "5", "--reserve-s", "1",
        "--device", "cpu", "--edition", "2", "--mtp-depths", "1", "--moe", "grouped"]
    assert train.main(args + ["--out", str(tmp_path / "one"), "--work-dir", str(tmp_path / "w1")]) == 0
    assert train.main(args + ["--out", str(tmp_path / "two"), "--work-dir", str(tmp_path / "w2"), "--stop-step", "3"]) == 0
    assert "stopped at step 3, 50 % of the schedule" in capsys.readouterr().err
    assert train.main(["--resume", str(tmp_path / "w2" / "last.pt"), "--out", str(tmp_path / "two"), "--work-dir",
                       str(tmp_path / "w2"), "--device", "cpu", "--max-minutes", "5", "--reserve-s", "1"]) == 0
    assert "stopped at step" not in capsys.readouterr().err
    one, two = (torch.load(tmp_path / w / "last.pt", weights_only=False) for w in ("w1", "w2"))
    assert one["run"]["step"] == two["run"]["step"] == 6 and one["run"]["tokens"] == two["run"]["tokens"]
    for part in ("target", "draft"):
        for name, t in one[part].items():
            assert torch.equal(t, two[part][name]), (part, name)
