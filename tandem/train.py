"""`tandem train`: a small DeepSeek-V3 model (MLA, noaux_tc MoE, one MTP layer) on Python code.

The config, its editions, and the training loop: AdamW, linear warmup then cosine by progress (steps or the
time budget), noaux_tc bias balancing, periodic held-out evals keeping the best weights, export. Data:
tandem/train_data.py (the stdlib split by file, --extra training-only code); the model, the losses (main +
MTP, chained MTP depths) and scoring: tandem/train_model.py.

    tandem train --edition 2 --corpus /tmp/c/stdlib --extra /tmp/c/extra --compile true --out /tmp/ck
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.config import ModelConfig
from tandem.train_data import EOS, held_windows, prepare_data, sample_batch, token_bytes, token_stream  # noqa: F401
from tandem.train_model import MOE_FORWARD, autocast, build_models, evaluate, export, forward_losses

ARCH_1 = dict(  # edition 1, the first bundled model: ~15.5 M parameters with the MTP layer, 31 MB in bf16
    vocab_size=8192, hidden_size=256, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=768, moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
ARCH = dict(  # edition 2 (issue 18), bundled: 20 layers of 256, 23.5 M parameters, 47 MB in bf16; one MTP step costs
    vocab_size=8192, hidden_size=256, num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=8,  # ~0.1 of
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,  # a target step
    intermediate_size=768, moe_intermediate_size=96, n_routed_experts=8, n_shared_experts=1,  # (CPU, batch 1-32)
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
ARCH_3 = {**ARCH, "num_hidden_layers": 40}  # edition 3 (issue 18, trained, not adopted): twice as deep, 40.8 M + 1.05 M
# parameters, 46.7 MiB exported in fp8: a target step is ~2x edition 2's where steps are launch-bound (the H200),
# so the one-layer MTP step is half the fraction of it; routed experts grouped (a step's MoE FLOPs / 4)
# --edition: the shape, schedule, pre-tokenizer ("gpt2": byte-level pre-tokens, GPT-2's split; "code": models/tiny.py
# CODE_SPLIT, a line break its own pre-token), residual init (depth_init: output projections at std / sqrt(2 x
# layers), as GPT-2) and MTP objective of each bundled model; other flags override them. Edition 2 also wants
# --extra (`tandem corpus`'s extra/): without it, it trains on the stdlib alone
EDITIONS = {1: dict(arch=ARCH_1, lr=2e-3, max_steps=0, eval_every=500, pre_tokens="gpt2", depth_init=False, moe="dense"),
            2: dict(arch=ARCH, lr=2e-3, max_steps=0, eval_every=250, pre_tokens="code", depth_init=True, moe="dense",
                    corpus_repeat=2, mtp_depths=3, chain_rows=16, train_minutes=6.55, max_minutes=9.3, reserve_s=30.0),
            3: dict(arch=ARCH_3, lr=1.5e-3, max_steps=0, eval_every=500, pre_tokens="code", depth_init=True, moe="grouped",
                    corpus_repeat=2, mtp_depths=3, chain_rows=16, train_minutes=14.0, max_minutes=9.3, reserve_s=45.0,
                    export_fp8=True)}


@dataclass
class TrainConfig:
    out: str = "checkpoints/tandem-code-mini"
    work_dir: str = "build/train-work"         # resumable state (weights + optimizer), never shipped
    resume: str = ""                          # a work checkpoint (last.pt) to continue from
    corpus: str = ""                          # stdlib root, split by file (default: the running Python's)
    extra: str = ""                           # training-only .py files (`tandem corpus`'s extra/), never held out
    corpus_repeat: int = 1                    # the stdlib training files' weight in the stream against --extra
    max_files: int = 0                        # 0: all (small for smoke tests)
    heldout_frac: float = 0.05
    seed: int = 0
    edition: int = 2                          # EDITIONS: 2 the bundled model (issue 18), 1 the first, 5-layer one
    arch: dict = field(default_factory=lambda: dict(ARCH))  # config.json fields; --arch KEY=JSON overrides
    seq_len: int = 1024
    batch_size: int = 64                      # sequences per optimizer step
    micro_batch: int = 64                     # sequences per forward
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3
    mtp_depths: int = 1                       # > 1: also train the MTP layer chained on its own output, as drafts run
    mtp_chain_lambda: float = 0.15            # the weight of each chained depth's CE
    chain_rows: int = 0                       # sequences per micro-batch the chained depths see (0: all)
    bias_gamma: float = 1e-3
    max_steps: int = 0                        # 0: the time budget
    max_minutes: float = 10.0                 # the whole command, data and export included
    train_minutes: float = 0.0                # > 0: the schedule's length in training time (may span --resume calls)
    stop_step: int = 0                        # > 0: this call stops after that step; --resume goes on with the schedule
    reserve_s: float = 45.0                   # of that, kept for the final eval and export
    eval_every: int = 500
    eval_seqs: int = 64                       # periodic eval; the final one uses up to 8x
    save_every_minutes: float = 3.0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    compile: bool = False
    depth_init: bool = False                  # set by --edition
    export_fp8: bool = False                  # the export in DeepSeek's fp8 block format (train_model.export)
    moe: str = "dense"                        # routed experts: "dense" (all, gated) or "grouped" (top-k rows, grouped GEMMs)


def model_config(c: TrainConfig) -> dict:
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **c.arch, norm_topk_prob=True,
                num_nextn_predict_layers=1, scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1,
                moe_layer_freq=1, ep_size=1, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=2 * c.seq_len,
                rope_theta=10000.0, rope_scaling=None, rope_interleave=True, attention_bias=False, attention_dropout=0.0,
                initializer_range=0.02, tie_word_embeddings=False, use_cache=True, pad_token_id=0, bos_token_id=1,
                eos_token_id=EOS, torch_dtype="bfloat16")


def pre_tokenizer(c: TrainConfig):
    # the edition's tokenizer split: None is models/tiny.py's code split (CODE_SPLIT)
    from tokenizers import pre_tokenizers
    return None if EDITIONS[c.edition]["pre_tokens"] == "code" else pre_tokenizers.ByteLevel(add_prefix_space=False)


def schedule_progress(run: dict, c: TrainConfig) -> float:
    # the schedule's position, 0..1: steps of max_steps, or training time after the first (compiling) step of the budget;
    # the first steps of --resume calls (compiling again) are not on its clock either
    first = run.get("first_s", 0.0)
    by_time = (run["train_s"] - first - run.get("recompile_s", 0.0)) / max(run["budget_s"] - first, 1e-9)
    return max(by_time, run["step"] / c.max_steps if c.max_steps else 0.0)


def parse(argv: list[str]) -> TrainConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--edition", type=int, default=2, choices=sorted(EDITIONS))
    edition = EDITIONS[pre.parse_known_args(argv)[0].edition]
    p = argparse.ArgumentParser(prog="tandem train", description=__doc__.splitlines()[0])
    p.add_argument("--arch", action="append", default=[], metavar="KEY=JSON", help="config.json field, e.g. hidden_size=128")
    for f in (f for f in dataclasses.fields(TrainConfig) if f.name != "arch"):
        kind, default = type(f.default), edition.get(f.name, f.default)
        conv = (lambda s: s.lower() in ("1", "true", "yes", "on")) if kind is bool else kind
        p.add_argument("--" + f.name.replace("_", "-"), type=conv, default=default, metavar=kind.__name__.upper())
    args = vars(p.parse_args(argv))
    if args["edition"] not in EDITIONS:
        p.error(f"--edition must be one of {sorted(EDITIONS)}, got {args['edition']}")
    if args["moe"] not in MOE_FORWARD:
        p.error(f"--moe must be one of {sorted(MOE_FORWARD)}, got {args['moe']!r}")
    if args["moe"] == "grouped" and args["compile"] and not args["device"].startswith("cuda"):
        p.error(f"--moe grouped with --compile true needs --device cuda (compiled grouped GEMMs are bf16), got {args['device']}")
    args["arch"] = {**edition["arch"], **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args["arch"])}}
    return TrainConfig(**args)


def main(argv: list[str]) -> int:
    from tqdm import tqdm
    t0, c = time.time(), parse(argv)
    state = torch.load(c.resume, map_location="cpu", weights_only=False) if c.resume else None
    if state:  # continue the saved run with its config, except where and for how long
        keep = ("out", "work_dir", "resume", "device", "max_minutes", "reserve_s", "compile", "eval_every", "stop_step")
        c = TrainConfig(**{**state["cfg"], **{k: getattr(c, k) for k in keep}})
    if c.edition >= 2 and not c.extra:
        print("tandem train: no --extra: training on the stdlib alone, not the bundled model's recipe (its --extra "
              "is `tandem corpus`'s extra/ folder; the model card has the command)", file=sys.stderr, flush=True)
    out, work = Path(c.out), Path(c.work_dir)
    out.mkdir(parents=True, exist_ok=True), work.mkdir(parents=True, exist_ok=True)
    train_ids, held_ids, corpus, nbytes = prepare_data(c, out, state is not None, pre_tokenizer(c))  # [N], [N_held], [V]
    cfg_raw = model_config(c)
    target, draft, moes, params = build_models(ModelConfig.from_dict(cfg_raw), c)
    n_target, n_mtp = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.mtp.parameters())
    print(f"parameters: target {n_target:,} + MTP layer {n_mtp:,} = {n_target + n_mtp:,}", flush=True)
    decay = [p for p in params if p.ndim >= 2 and p is not target.model.embed_tokens.weight]
    rest = [p for p in params if all(p is not q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.95), **({"fused": True} if c.device.startswith("cuda") else {}))
    g = torch.Generator(c.device).manual_seed(c.seed + 17)
    deadline = t0 + c.max_minutes * 60 - c.reserve_s
    budget = c.train_minutes * 60 or deadline - time.time()         # the schedule: may outlast this call
    run = dict(step=0, tokens=0, train_s=0.0, evals=[], budget_s=max(budget, 1.0))
    if state:
        target.load_state_dict(state["target"]), draft.load_state_dict(state["draft"]), opt.load_state_dict(state["opt"])
        run, _ = state["run"], g.set_state(state["rng"])

    def save_work():
        torch.save(dict(target=target.state_dict(), draft=draft.state_dict(), opt=opt.state_dict(), run=run,
                        rng=g.get_state(), cfg=asdict(c)), work / "last.pt")

    # one graph for the whole step: on the H200 edition 2 ran 536 k tokens/s (layer by layer ~480 k, compiling as long)
    fwd = torch.compile(forward_losses) if c.compile else forward_losses
    best, best_loss, recent, accum = None, float("inf"), [], c.batch_size // c.micro_batch
    bar = tqdm(total=c.max_steps or None, initial=run["step"], unit="step", dynamic_ncols=True, mininterval=2)
    last_save, t_log, tok_log, steady = time.time(), time.time(), run["tokens"], None
    while (time.time() < deadline and (progress := schedule_progress(run, c)) < 1
           and not (c.stop_step and run["step"] >= c.stop_step)):
        t_step, cos = time.time(), 0.5 * (1 + math.cos(math.pi * progress))   # linear warmup, then cosine by progress
        lr = c.lr * min((run["step"] + 1) / c.warmup_steps, c.min_lr_frac + (1 - c.min_lr_frac) * cos)
        for grp in opt.param_groups:
            grp["lr"] = lr
        for _ in range(accum):
            chunk = sample_batch(train_ids, c.micro_batch, c.seq_len, g)   # [b, T+1]
            with autocast(c.device):
                main, ces, _, _ = fwd(target, draft, chunk, c.mtp_depths, c.chain_rows)
            mtp, chain = ces[0], torch.stack(ces[1:]).mean() if len(ces) > 1 else torch.zeros_like(ces[0])
            ((main + c.mtp_lambda * mtp + c.mtp_chain_lambda * (len(ces) - 1) * chain) / accum).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # noaux_tc balancing: under-loaded experts up by gamma, over-loaded down
            for m in moes:
                m.gate.e_score_correction_bias += c.bias_gamma * torch.sign(m.expert_load.mean() - m.expert_load)
                m.expert_load.zero_()
        run["step"], run["tokens"] = run["step"] + 1, run["tokens"] + c.batch_size * c.seq_len
        recent = (recent + [torch.stack([main, mtp, gnorm, chain]).detach()])[-50:]
        if run["step"] % 10 == 0:  # the only host syncs of a step
            (rm, rt, rg, rc), now = torch.stack(recent).mean(0).tolist(), time.time()
            bar.set_postfix(loss=f"{rm:.3f}", mtp=f"{rt:.3f}", chain=f"{rc:.3f}", gn=f"{rg:.2f}", lr=f"{lr:.1e}",
                            refresh=False,
                            tok_s=f"{(run['tokens'] - tok_log) / (now - t_log):,.0f}")
            t_log, tok_log = now, run["tokens"]
        bar.update()
        run["train_s"] += time.time() - t_step
        if steady is None and "first_s" in run:             # a --resume call's first step: compiling again
            run["recompile_s"] = run.get("recompile_s", 0.0) + time.time() - t_step
        steady = steady or (run["tokens"], run["train_s"])  # after this process's first (compiling) step
        run.setdefault("first_s", run["train_s"])
        if run["step"] % c.eval_every == 0:
            ev, (rm, rt, _, _) = evaluate(target, draft, held_ids, c, c.eval_seqs), torch.stack(recent).mean(0).tolist()
            run["evals"].append(dict(step=run["step"], tokens=run["tokens"], train_loss=rm, train_mtp_loss=rt, **ev))
            bar.write(f"step {run['step']} tokens {run['tokens']:,} train {rm:.3f}/{rt:.3f} held-out {ev['loss']:.3f}/"
                      f"{ev['mtp_loss']:.3f} mtp_acc {ev['mtp_acc']:.3f} agree {ev['mtp_agree_greedy']:.3f}" +
                      "".join(f" mtp{d}_acc {ev[f'mtp{d}_acc']:.3f}" for d in range(2, c.mtp_depths + 1)))
            if ev["loss"] < best_loss:  # keep the best held-out weights, in case later epochs overfit
                best_loss, best = ev["loss"], ([{k: v.clone() for k, v in m.state_dict().items()} for m in (target, draft)],
                                               run["evals"][-1])
        if time.time() - last_save > c.save_every_minutes * 60:
            save_work()
            last_save = time.time()
    bar.close()
    save_work()
    if (progress := schedule_progress(run, c)) < 1:
        print(f"tandem train: stopped at step {run['step']}, {100 * progress:.0f} % of the schedule; the export is "
              f"these weights; continue with --resume {work / 'last.pt'}", file=sys.stderr, flush=True)
    rm, rt, _, _ = torch.stack(recent).mean(0).tolist() if recent else [float("nan")] * 4
    chosen = dict(step=run["step"], train_loss=rm, train_mtp_loss=rt)
    if best is not None and evaluate(target, draft, held_ids, c, c.eval_seqs)["loss"] > best_loss:
        target.load_state_dict(best[0][0]), draft.load_state_dict(best[0][1])
        chosen = best[1]
    final, ckpt_bytes = evaluate(target, draft, held_ids, c, 0, nbytes), export(target, draft, cfg_raw, out, c.export_fp8)
    cuda = c.device.startswith("cuda")
    log = dict(steps=run["step"], tokens_seen=run["tokens"], epochs=run["tokens"] / train_ids.numel(),
               exported_step=chosen["step"], final_train_loss=chosen["train_loss"],
               final_train_mtp_loss=chosen["train_mtp_loss"], **{f"heldout_{k}": v for k, v in final.items()},
               train_seconds=run["train_s"], wall_seconds=time.time() - t0, tokens_per_s=run["tokens"] / run["train_s"],
               tokens_per_s_after_first_step=(run["tokens"] - steady[0]) / max(run["train_s"] - steady[1], 1e-9),
               peak_gpu_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, checkpoint_bytes=ckpt_bytes,
               params=dict(target=n_target, mtp_layer=n_mtp, total=n_target + n_mtp), corpus=corpus,
               device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command="tandem train " + " ".join(argv),
               config=asdict(c), evals=run["evals"])
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: v for k, v in log.items() if k not in ("config", "evals")}, indent=1))
    return 0
