"""`tandem train`: a small DeepSeek-V3 model (MLA, noaux_tc MoE, one MTP layer) on the Python stdlib.

Loss: CE(next token) + mtp_lambda * CE(token t+2 from the final-norm hidden h[t] and embed(t+1)); the
MTP gradient flows into the main model (no detach), as in DeepSeek-V3, and the MTP layer shares the
target's embedding and LM head Parameters. Routed experts run densely (every expert on every token, the
gate zero off the top-k): the function and gradients of sparse routing, in three matmuls, no host sync.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.loader import build, checkpoint_tensors, save_checkpoint
from models.model import DraftModel, TargetModel
from models.moe import MoE
from models.tiny import init_random_, train_tokenizer

EOS, SKIP_DIRS = 2, {"site-packages", "dist-packages", "__pycache__"}  # test dirs are kept: code too
ARCH_1 = dict(  # edition 1, today's bundled model: ~15.5 M parameters with the MTP layer, 31 MB in bf16
    vocab_size=8192, hidden_size=256, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=768, moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
ARCH = dict(  # edition 2 (issue 18, not adopted yet): 22 layers of width 192, one MTP step ~1/10 of a target step on
    vocab_size=8192, hidden_size=192, num_hidden_layers=22, num_attention_heads=6, num_key_value_heads=6,  # CPU; 43.7 MB
    q_lora_rank=128, kv_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    intermediate_size=576, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
# --edition: the shape, schedule and pre-tokenizer of each bundled model ("gpt2": byte-level pre-tokens, GPT-2's
# split; "code": models/tiny.py CODE_SPLIT, a line break its own pre-token); other flags override them
EDITIONS = {1: dict(arch=ARCH_1, lr=2e-3, max_steps=0, eval_every=500, pre_tokens="gpt2"),
            2: dict(arch=ARCH, lr=1.5e-3, max_steps=1200, eval_every=100, pre_tokens="code")}


@dataclass
class TrainConfig:
    out: str = "checkpoints/tandem-code-mini"
    work_dir: str = "build/train-work"         # resumable state (weights + optimizer), never shipped
    resume: str = ""                          # a work checkpoint (last.pt) to continue from
    corpus: str = ""                          # default: the running Python's stdlib root
    pack_corpus: str = ""                     # write the corpus's files (train + held-out) to this .tar.xz, exit
    max_files: int = 0                        # 0: all (small for smoke tests)
    heldout_frac: float = 0.05
    seed: int = 0
    edition: int = 1                          # EDITIONS: 1 today's bundled model, 2 the deeper one of issue 18
    arch: dict = field(default_factory=lambda: dict(ARCH_1))  # config.json fields; --arch KEY=JSON overrides
    seq_len: int = 1024
    batch_size: int = 64                      # sequences per optimizer step
    micro_batch: int = 64                     # sequences per forward
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3
    bias_gamma: float = 1e-3
    max_steps: int = 0                        # 0: the time budget (edition 2: 1200, ~9.5 epochs of 8.3 M tokens)
    max_minutes: float = 10.0                 # the whole command, data and export included
    reserve_s: float = 45.0                   # of that, kept for the final eval and export
    eval_every: int = 500
    eval_seqs: int = 64                       # periodic eval; the final one uses up to 8x
    save_every_minutes: float = 3.0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    compile: bool = False


def model_config(c: TrainConfig) -> dict:
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **c.arch, norm_topk_prob=True,
                num_nextn_predict_layers=1, scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1,
                moe_layer_freq=1, ep_size=1, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=2 * c.seq_len,
                rope_theta=10000.0, rope_scaling=None, rope_interleave=True, attention_bias=False, attention_dropout=0.0,
                initializer_range=0.02, tie_word_embeddings=False, use_cache=True, pad_token_id=0, bos_token_id=1,
                eos_token_id=EOS, torch_dtype="bfloat16")


def split_corpus(root: Path, c: TrainConfig) -> tuple[list[str], list[str]]:
    # the .py files under 1 MiB as sorted relative posix paths -> (train, held-out), split by a seeded shuffle
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and p.stat().st_size < 1 << 20)
    files = files[: c.max_files] if c.max_files else files
    order = list(range(len(files)))
    random.Random(c.seed).shuffle(order)
    held = set(order[: max(1, round(c.heldout_frac * len(files)))])
    return [f for i, f in enumerate(files) if i not in held], [f for i, f in enumerate(files) if i in held]


def pack_corpus(c: TrainConfig) -> int:
    """The corpus's files as one .tar.xz (paths relative to the root): a GPU machine whose Python differs
    unpacks it and trains with --corpus on the same files and the same split."""
    import tarfile
    root = Path(c.corpus or Path(os.__file__).parent)
    train_files, held_files = split_corpus(root, c)
    Path(c.pack_corpus).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(c.pack_corpus, "w:xz") as tar:
        for f in sorted(train_files + held_files):
            tar.add(root / f, arcname=f)
    print(f"{c.pack_corpus}: {len(train_files) + len(held_files)} files of {root} "
          f"({Path(c.pack_corpus).stat().st_size:,} bytes)")
    return 0


def token_stream(tok, root: Path, files: list[str]) -> torch.Tensor:
    # -> [n_tokens] int64: each file's tokens followed by </s>
    ids = (e.ids + [EOS] for e in tok.encode_batch([(root / f).read_text(errors="ignore") for f in files]))
    return torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)


def prepare_data(c: TrainConfig, out: Path, reuse_tokenizer: bool):
    from tokenizers import Tokenizer
    root = Path(c.corpus or Path(os.__file__).parent)
    train_files, held_files = split_corpus(root, c)
    (out / "heldout_files.json").write_text(json.dumps(dict(
        root=str(root), python=sys.version.split()[0], seed=c.seed, fraction=c.heldout_frac,
        n_train_files=len(train_files), n_heldout_files=len(held_files), files=held_files), indent=1))
    if not (reuse_tokenizer and (out / "tokenizer.json").exists()):
        from tokenizers import pre_tokenizers
        pre = None if EDITIONS[c.edition]["pre_tokens"] == "code" else pre_tokenizers.ByteLevel(add_prefix_space=False)
        train_tokenizer(((root / f).read_text(errors="ignore") for f in train_files), c.arch["vocab_size"], out, pre)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train_ids, held_ids = (token_stream(tok, root, fs).to(c.device) for fs in (train_files, held_files))
    info = dict(root=str(root), python=sys.version.split()[0], train_files=len(train_files),
                heldout_files=len(held_files), train_tokens=train_ids.numel(), heldout_tokens=held_ids.numel(),
                heldout_bytes=sum(len((root / f).read_text(errors="ignore").encode()) for f in held_files))
    print(f"corpus: {info}", flush=True)
    return train_ids, held_ids, info, token_bytes(tok)


def sample_batch(stream: torch.Tensor, n: int, T: int, g: torch.Generator) -> torch.Tensor:
    # n random windows of the stream -> [n, T + 1] (g lives on the stream's device: no host sync)
    starts = torch.randint(0, stream.numel() - T - 1, (n, 1), generator=g, device=stream.device)
    return stream[starts + torch.arange(T + 1, device=stream.device)]


def dense_moe_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    # x: [..., D] -> [..., D]; replaces MoE.forward on single-rank training modules
    shape, x = x.shape, x.reshape(-1, x.shape[-1])                         # [N, D]
    w, ids = self.gate(x)                                                  # [N, k] fp32, [N, k]
    gates = torch.zeros(x.shape[0], self.num_experts, device=x.device, dtype=w.dtype).scatter(1, ids, w)  # [N, E]
    if self.training:
        self.expert_load += torch.zeros_like(gates).scatter(1, ids, 1.0).sum(0)           # [E] tokens routed
    ex = [self.experts[str(e)] for e in range(self.num_experts)]
    w_gu = torch.cat([m.gate_proj.weight for m in ex] + [m.up_proj.weight for m in ex])  # [2*E*I, D]
    g, u = F.linear(x, w_gu).chunk(2, -1)                                  # [N, E*I] each
    a = (F.silu(g) * u).view(x.shape[0], self.num_experts, -1) * gates.to(g.dtype)[..., None]  # [N, E, I]
    y = F.linear(a.flatten(1), torch.cat([m.down_proj.weight for m in ex], 1))  # [N, D]
    if hasattr(self, "shared_experts"):
        y = y + self.shared_experts(x)
    return y.view(shape)


def build_models(cfg: ModelConfig, c: TrainConfig):
    target = init_random_(build(TargetModel, cfg, device=c.device), c.seed).train()
    draft = init_random_(build(DraftModel, cfg, device=c.device), c.seed + 1).train()
    draft.embed_tokens.weight, draft.lm_head.weight = target.model.embed_tokens.weight, target.lm_head.weight  # shared
    params = list({id(p): p.requires_grad_(True) for p in itertools.chain(target.parameters(), draft.parameters())}.values())
    moes = [m for m in itertools.chain(target.modules(), draft.modules()) if isinstance(m, MoE)]
    for m in moes:  # the bias is moved by the load rule, never by gradients
        m.gate.e_score_correction_bias.requires_grad_(False).zero_()
        m.register_buffer("expert_load", torch.zeros(m.num_experts, device=c.device), persistent=False)
        m.forward = dense_moe_forward.__get__(m)
    return target, draft, moes, [p for p in params if p.requires_grad]


def forward_losses(target, draft, chunk: torch.Tensor):
    # chunk: [B, T+1] -> main CE, MTP CE, main logits [B, T, V], MTP logits [B, T-1, V]
    inp = chunk[:, :-1]                                                    # [B, T]
    h = target(inp, None, None)                                            # [B, T, D] final-norm hidden
    logits = target.compute_logits(h)                                      # [B, T, V] fp32
    main = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
    mh = draft(inp[:, 1:], h[:, :-1], None, None)                          # pairs (h[t], x[t+1]) -> [B, T-1, D]
    mlogits = draft.compute_logits(mh)                                     # [B, T-1, V], predicts x[t+2]
    return main, F.cross_entropy(mlogits.flatten(0, 1), chunk[:, 2:].flatten()), logits, mlogits


def autocast(c: TrainConfig):
    return torch.autocast("cuda", torch.bfloat16) if c.device.startswith("cuda") else torch.autocast("cpu", enabled=False)


def token_bytes(tok) -> torch.Tensor:
    # -> [V] float: UTF-8 bytes each token stands for (byte-level BPE: one character per byte; specials 0)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    return torch.tensor([0.0 if (s := tok.id_to_token(i)) is None or s in special else float(len(s))
                         for i in range(tok.get_vocab_size())])


def held_windows(held: torch.Tensor, T: int, n_seqs: int) -> list[torch.Tensor]:
    # [N] -> min(n_seqs, all) [T+1] windows, each predicting the T tokens after the last one's; n_seqs 0: all, and
    # the tail as a shorter window (unless it predicts one token only)
    n = (held.numel() - 1) // T
    full = [held[i * T: i * T + T + 1] for i in range(n) if i * T + T + 1 <= held.numel()]
    tail = held[len(full) * T:]
    return full[:n_seqs] if n_seqs else full + ([tail] if tail.numel() >= 3 else [])


@torch.no_grad()
def evaluate(target, draft, held: torch.Tensor, c: TrainConfig, n_seqs: int, nbytes: torch.Tensor | None = None) -> dict:
    """Held-out loss / perplexity / bits per byte of the main model (token t+1) and of the MTP layer (t+2),
    over n_seqs windows of seq_len + 1 tokens (0: the whole stream); nbytes [V]: bytes per token id."""
    windows, sums = held_windows(held, c.seq_len, n_seqs), torch.zeros(8, dtype=torch.float64, device=held.device)
    target.eval(), draft.eval()
    groups = itertools.groupby(windows, key=len)
    for _, same in groups:
        same = list(same)
        for i in range(0, len(same), c.micro_batch):
            chunk = torch.stack(same[i: i + c.micro_batch])                 # [b, T+1]
            with autocast(c):
                _, _, logits, mlogits = forward_losses(target, draft, chunk)
            y, y2 = chunk[:, 1:], chunk[:, 2:]
            nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            mnll = F.cross_entropy(mlogits.float().flatten(0, 1), y2.flatten(), reduction="sum")
            pred, mpred = logits.argmax(-1), mlogits.argmax(-1)  # [b, T], [b, T-1]; MTP vs true t+2 and vs greedy t+1
            b = nbytes.to(held.device)[y].sum() if nbytes is not None else torch.zeros((), device=held.device)
            sums += torch.stack([nll, mnll, (pred == y).sum(), (mpred == y2).sum(), (mpred == pred[:, 1:]).sum(),
                                 torch.tensor(y.numel(), device=held.device), torch.tensor(y2.numel(), device=held.device),
                                 b]).double()
    target.train(), draft.train()
    s = sums.tolist()
    return dict(loss=s[0] / s[5], ppl=math.exp(s[0] / s[5]), mtp_loss=s[1] / s[6], main_acc=s[2] / s[5],
                mtp_acc=s[3] / s[6], mtp_agree_greedy=s[4] / s[6], eval_tokens=int(s[5]),
                **(dict(bits_per_byte=s[0] / math.log(2) / s[7], eval_bytes=int(s[7])) if nbytes is not None else {}))


def export(target, draft, cfg_raw: dict, out: Path) -> int:
    # HF layout; the MTP layer's embed_tokens / shared_head.head are left out (the loader falls back)
    L = cfg_raw["num_hidden_layers"]
    tensors = {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
               for k, v in checkpoint_tensors(target, draft).items()
               if k not in (f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight")}
    [f.unlink() for f in [*out.glob("*.safetensors"), *out.glob("model.safetensors.index.json")]]   # stale shards
    save_checkpoint(tensors, out, max_shard_bytes=(16 << 20) - (64 << 10))   # each file <= 16 MiB with its header
    (out / "config.json").write_text(json.dumps(cfg_raw, indent=1))
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=1, eos_token_id=EOS, do_sample=False)))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def parse(argv: list[str]) -> TrainConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--edition", type=int, default=1, choices=sorted(EDITIONS))
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
    args["arch"] = {**edition["arch"], **{k: json.loads(v) for k, v in (a.split("=", 1) for a in args["arch"])}}
    return TrainConfig(**args)


def main(argv: list[str]) -> int:
    from tqdm import tqdm
    t0, c = time.time(), parse(argv)
    if c.pack_corpus:
        return pack_corpus(c)
    state = torch.load(c.resume, map_location="cpu", weights_only=False) if c.resume else None
    if state:  # continue the saved run with its config, except where and for how long
        keep = ("out", "work_dir", "resume", "device", "max_minutes", "reserve_s", "compile", "eval_every")
        c = TrainConfig(**{**state["cfg"], **{k: getattr(c, k) for k in keep}})
    out, work = Path(c.out), Path(c.work_dir)
    out.mkdir(parents=True, exist_ok=True), work.mkdir(parents=True, exist_ok=True)
    train_ids, held_ids, corpus, nbytes = prepare_data(c, out, reuse_tokenizer=state is not None)   # [N_train], [N_held], [V]
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
    run = dict(step=0, tokens=0, train_s=0.0, evals=[], budget_s=max(deadline - time.time(), 1.0))
    if state:
        target.load_state_dict(state["target"]), draft.load_state_dict(state["draft"]), opt.load_state_dict(state["opt"])
        run, _ = state["run"], g.set_state(state["rng"])

    def save_work():
        torch.save(dict(target=target.state_dict(), draft=draft.state_dict(), opt=opt.state_dict(), run=run,
                        rng=g.get_state(), cfg=asdict(c)), work / "last.pt")

    fwd = torch.compile(forward_losses) if c.compile else forward_losses
    best, best_loss, recent, accum = None, float("inf"), [], c.batch_size // c.micro_batch
    bar = tqdm(total=c.max_steps or None, initial=run["step"], unit="step", dynamic_ncols=True, mininterval=2)
    last_save, t_log, tok_log, steady = time.time(), time.time(), run["tokens"], None
    while time.time() < deadline and (progress := max(
            run["train_s"] / run["budget_s"], run["step"] / c.max_steps if c.max_steps else 0.0)) < 1:
        t_step, cos = time.time(), 0.5 * (1 + math.cos(math.pi * progress))   # linear warmup, then cosine by progress
        lr = c.lr * min((run["step"] + 1) / c.warmup_steps, c.min_lr_frac + (1 - c.min_lr_frac) * cos)
        for grp in opt.param_groups:
            grp["lr"] = lr
        for _ in range(accum):
            chunk = sample_batch(train_ids, c.micro_batch, c.seq_len, g)   # [b, T+1]
            with autocast(c):
                main, mtp, _, _ = fwd(target, draft, chunk)
            ((main + c.mtp_lambda * mtp) / accum).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # noaux_tc balancing: under-loaded experts up by gamma, over-loaded down
            for m in moes:
                m.gate.e_score_correction_bias += c.bias_gamma * torch.sign(m.expert_load.mean() - m.expert_load)
                m.expert_load.zero_()
        run["step"], run["tokens"] = run["step"] + 1, run["tokens"] + c.batch_size * c.seq_len
        recent = (recent + [torch.stack([main.detach(), mtp.detach(), gnorm.detach()])])[-50:]
        if run["step"] % 10 == 0:  # the only host syncs of a step
            (rm, rt, rg), now = torch.stack(recent).mean(0).tolist(), time.time()
            bar.set_postfix(loss=f"{rm:.3f}", mtp=f"{rt:.3f}", gn=f"{rg:.2f}", lr=f"{lr:.1e}", refresh=False,
                            tok_s=f"{(run['tokens'] - tok_log) / (now - t_log):,.0f}")
            t_log, tok_log = now, run["tokens"]
        bar.update()
        run["train_s"] += time.time() - t_step
        steady = steady or (run["tokens"], run["train_s"])  # after this process's first (compiling) step
        if run["step"] % c.eval_every == 0:
            ev, (rm, rt, _) = evaluate(target, draft, held_ids, c, c.eval_seqs), torch.stack(recent).mean(0).tolist()
            run["evals"].append(dict(step=run["step"], tokens=run["tokens"], train_loss=rm, train_mtp_loss=rt, **ev))
            bar.write(f"step {run['step']} tokens {run['tokens']:,} train {rm:.3f}/{rt:.3f} held-out {ev['loss']:.3f}/"
                      f"{ev['mtp_loss']:.3f} mtp_acc {ev['mtp_acc']:.3f} agree {ev['mtp_agree_greedy']:.3f}")
            if ev["loss"] < best_loss:  # keep the best held-out weights, in case later epochs overfit
                best_loss, best = ev["loss"], ([{k: v.clone() for k, v in m.state_dict().items()} for m in (target, draft)],
                                               run["evals"][-1])
        if time.time() - last_save > c.save_every_minutes * 60:
            save_work()
            last_save = time.time()
    bar.close()
    save_work()
    rm, rt, _ = torch.stack(recent).mean(0).tolist() if recent else [float("nan")] * 3
    chosen = dict(step=run["step"], train_loss=rm, train_mtp_loss=rt)
    if best is not None and evaluate(target, draft, held_ids, c, c.eval_seqs)["loss"] > best_loss:
        target.load_state_dict(best[0][0]), draft.load_state_dict(best[0][1])
        chosen = best[1]
    final, ckpt_bytes = evaluate(target, draft, held_ids, c, 0, nbytes), export(target, draft, cfg_raw, out)
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
