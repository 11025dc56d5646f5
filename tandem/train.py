"""`tandem train`: a small DeepSeek-V3 model (MLA, noaux_tc MoE, one MTP layer) on the Python stdlib.

Corpus: every .py file under the stdlib root (site-packages skipped), split by file with a fixed
seed. Loss: CE(next token) + mtp_lambda * CE(token t+2 from final-norm hidden h[t] and embed(t+1)),
the MTP gradient flowing into the main model as in DeepSeek-V3. The MTP layer shares the target's
embedding and LM head (same Parameters). Routed experts run densely (every expert on every token,
weighted by a gate that is zero off the top-k): the same function and gradients as sparse routing,
but three large matmuls and no host sync. The noaux_tc bias is nudged by +-gamma from expert load.
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.loader import build, checkpoint_tensors, save_checkpoint
from models.model import DraftModel, TargetModel
from models.moe import MoE
from models.tiny import init_random_, train_tokenizer

EOS, SKIP_DIRS, TEST_DIRS = 2, {"site-packages", "dist-packages", "__pycache__"}, {"test", "tests", "idle_test"}


@dataclass
class TrainConfig:
    out: str = "checkpoints/tandem-code-mini"
    work_dir: str = "build/train-work"          # resumable state (optimizer etc.), never shipped
    resume: str = ""                           # path of a work checkpoint (last.pt) to continue
    corpus: str = ""                           # default: the running Python's stdlib root
    skip_tests: bool = False
    max_files: int = 0                         # 0: all (small values for smoke tests)
    heldout_frac: float = 0.05
    seed: int = 0
    # model (DeepSeek-V3 layout)
    vocab_size: int = 8192
    hidden_size: int = 256
    layers: int = 5                            # first dense, the rest MoE; + 1 MTP layer (MoE)
    heads: int = 8
    q_lora_rank: int = 192
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    # optimisation
    seq_len: int = 1024
    batch_size: int = 64                       # sequences per optimizer step
    micro_batch: int = 64                      # sequences per forward
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3
    bias_gamma: float = 1e-3
    max_steps: int = 0                         # 0: until the time budget runs out
    max_minutes: float = 10.0                  # whole command, preprocessing and export included
    reserve_s: float = 45.0                    # kept back from the budget for final eval + export
    eval_every: int = 500
    eval_seqs: int = 64                        # periodic eval; the final eval uses up to 8x this
    save_every_minutes: float = 3.0
    log_every: int = 10
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    compile: bool = False


def model_config(c: TrainConfig) -> dict:
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.layers, num_nextn_predict_layers=1, num_attention_heads=c.heads,
        num_key_value_heads=c.heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        n_routed_experts=c.n_routed_experts, n_shared_experts=c.n_shared_experts, num_experts_per_tok=c.experts_per_tok,
        n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1, moe_layer_freq=1, ep_size=1,
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=2 * c.seq_len, rope_theta=10000.0,
        rope_scaling=None, rope_interleave=True, attention_bias=False, attention_dropout=0.0,
        initializer_range=0.02, tie_word_embeddings=False, use_cache=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=EOS, torch_dtype="bfloat16")


# --- data ----------------------------------------------------------------------------------------
def corpus_files(root: Path, c: TrainConfig) -> list[str]:
    # -> sorted relative posix paths of the .py files (deterministic on a given stdlib)
    skip = SKIP_DIRS | (TEST_DIRS if c.skip_tests else set())
    rel = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                 if p.is_file() and not skip & set(p.relative_to(root).parts[:-1]) and p.stat().st_size < 1 << 20)
    return rel[: c.max_files] if c.max_files else rel


def split_files(files: list[str], c: TrainConfig) -> tuple[list[str], list[str]]:
    order = list(range(len(files)))
    random.Random(c.seed).shuffle(order)
    n_held = max(1, round(c.heldout_frac * len(files)))
    held = set(order[:n_held])
    return [f for i, f in enumerate(files) if i not in held], [f for i, f in enumerate(files) if i in held]


def token_stream(tok, root: Path, files: list[str]) -> torch.Tensor:
    # -> [n_tokens] int64: every file's tokens followed by </s>
    texts = [(root / f).read_text(errors="ignore") for f in files]
    ids = (e.ids + [EOS] for e in tok.encode_batch(texts))
    return torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)


def sample_batch(stream: torch.Tensor, n: int, T: int, g: torch.Generator) -> torch.Tensor:
    # random windows -> [n, T + 1] on the stream's device
    starts = torch.randint(0, stream.numel() - T - 1, (n, 1), generator=g).to(stream.device)
    return stream[starts + torch.arange(T + 1, device=stream.device)]


# --- model ---------------------------------------------------------------------------------------
def dense_moe_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    # x: [..., D] -> [..., D]; bound to each MoE module for training (single rank)
    shape, x = x.shape, x.reshape(-1, x.shape[-1])                         # [N, D]
    w, ids = self.gate(x)                                                  # [N, k] fp32, [N, k]
    E = self.num_experts
    gates = torch.zeros(x.shape[0], E, device=x.device, dtype=w.dtype).scatter(1, ids, w)  # [N, E]
    if self.training:
        self.expert_load += torch.zeros_like(gates).scatter(1, ids, 1.0).sum(0)           # [E]
    ex = [self.experts[str(e)] for e in range(E)]
    w_gu = torch.cat([m.gate_proj.weight for m in ex] + [m.up_proj.weight for m in ex])  # [2*E*I, D]
    w_d = torch.cat([m.down_proj.weight for m in ex], 1)                   # [D, E*I]
    g, u = F.linear(x, w_gu).chunk(2, -1)                                  # [N, E*I] each
    a = (F.silu(g) * u).view(x.shape[0], E, -1) * gates.to(g.dtype)[..., None]
    y = F.linear(a.flatten(1), w_d)                                        # [N, D]
    if hasattr(self, "shared_experts"):
        y = y + self.shared_experts(x)
    return y.view(shape)


def build_models(cfg: ModelConfig, c: TrainConfig):
    torch.manual_seed(c.seed)
    target = init_random_(build(TargetModel, cfg, device=c.device), c.seed)
    draft = init_random_(build(DraftModel, cfg, device=c.device), c.seed + 1)
    draft.embed_tokens.weight = target.model.embed_tokens.weight      # shared, as DeepSeek ships them
    draft.lm_head.weight = target.lm_head.weight
    moes = [m for m in itertools.chain(target.modules(), draft.modules()) if isinstance(m, MoE)]
    for m in moes:
        m.gate.e_score_correction_bias.data.zero_()
        m.register_buffer("expert_load", torch.zeros(m.num_experts, device=c.device), persistent=False)
        m.forward = dense_moe_forward.__get__(m)
    params = {id(p): p for p in itertools.chain(target.parameters(), draft.parameters())}
    for p in params.values():
        p.requires_grad_(True)
    for m in moes:  # moved by the load rule below, never by gradients
        m.gate.e_score_correction_bias.requires_grad_(False)
    return target, draft, moes, [p for p in params.values() if p.requires_grad]


def forward_losses(target, draft, chunk: torch.Tensor):
    # chunk: [B, T+1] -> main CE, MTP CE, main logits [B, T, V], MTP logits [B, T-1, V]
    inp = chunk[:, :-1]                                                    # [B, T]
    h = target(inp, None, None)                                            # [B, T, D] final norm
    logits = target.compute_logits(h)                                      # [B, T, V] fp32
    main = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
    g = draft(inp[:, 1:], h[:, :-1], None, None)                           # pairs (h[t], x[t+1]) -> [B, T-1, D]
    mlogits = draft.compute_logits(g)                                      # [B, T-1, V]
    mtp = F.cross_entropy(mlogits.flatten(0, 1), chunk[:, 2:].flatten())
    return main, mtp, logits, mlogits


@torch.no_grad()
def evaluate(fwd, target, draft, held: torch.Tensor, c: TrainConfig, n_seqs: int) -> dict:
    T = c.seq_len
    n = min(n_seqs, (held.numel() - 1) // (T + 1))
    windows = held[: n * (T + 1)].view(n, T + 1)
    target.eval(), draft.eval()
    sums = torch.zeros(5, device=held.device)
    for i in range(0, n, c.micro_batch):
        chunk = windows[i: i + c.micro_batch]                              # [b, T+1]
        with autocast(c):
            main, mtp, logits, mlogits = fwd(target, draft, chunk)
        pred, mpred = logits.argmax(-1), mlogits.argmax(-1)                # [b, T], [b, T-1]
        # MTP top-1 vs the true t+2 token, and vs the main model's own greedy choice at t+1
        sums += len(chunk) * torch.stack([main, mtp, (pred == chunk[:, 1:]).float().mean(),
                                          (mpred == chunk[:, 2:]).float().mean(), (mpred == pred[:, 1:]).float().mean()])
    target.train(), draft.train()
    s = (sums / n).tolist()
    return dict(loss=s[0], ppl=math.exp(s[0]), mtp_loss=s[1], main_acc=s[2], mtp_acc=s[3], mtp_agree_greedy=s[4],
                eval_tokens=n * T)


def autocast(c: TrainConfig):
    return torch.autocast("cuda", torch.bfloat16) if c.device.startswith("cuda") else torch.autocast("cpu", enabled=False)


def lr_at(step: int, progress: float, c: TrainConfig) -> float:
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def export(target, draft, cfg_raw: dict, out: Path) -> int:
    # HF layout; the MTP layer's embed_tokens / shared_head.head are omitted (the loader falls back)
    L = cfg_raw["num_hidden_layers"]
    tensors = checkpoint_tensors(target, draft)
    for k in (f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"):
        tensors.pop(k)
    tensors = {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
               for k, v in tensors.items()}
    for f in itertools.chain(out.glob("*.safetensors"), out.glob("model.safetensors.index.json")):
        f.unlink()
    save_checkpoint(tensors, out, max_shard_bytes=16 << 20)
    (out / "config.json").write_text(json.dumps(cfg_raw, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": 0, "do_sample": False}, indent=1))
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- the run -------------------------------------------------------------------------------------
def parse(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser(prog="tandem train", description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        kind = type(f.default)
        conv = (lambda s: s.lower() in ("1", "true", "yes", "on")) if kind is bool else kind
        p.add_argument("--" + f.name.replace("_", "-"), type=conv, default=f.default, metavar=kind.__name__.upper())
    return TrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer
    from tqdm import tqdm
    t0 = time.time()
    c = parse(argv)
    state = torch.load(c.resume, map_location="cpu", weights_only=False) if c.resume else None
    if state:  # continue the saved run: its config, except where and how long
        keep = {k: getattr(c, k) for k in ("out", "work_dir", "resume", "device", "max_minutes", "compile", "eval_every")}
        c = TrainConfig(**{**state["cfg"], **keep})
    out, work = Path(c.out), Path(c.work_dir)
    out.mkdir(parents=True, exist_ok=True), work.mkdir(parents=True, exist_ok=True)
    root = Path(c.corpus or Path(os.__file__).parent)
    train_files, held_files = split_files(corpus_files(root, c), c)
    (out / "heldout_files.json").write_text(json.dumps(dict(
        root=str(root), python=sys.version.split()[0], seed=c.seed, fraction=c.heldout_frac,
        n_train_files=len(train_files), n_heldout_files=len(held_files), files=held_files), indent=1))
    if not (state and (out / "tokenizer.json").exists()):
        train_tokenizer(((root / f).read_text(errors="ignore") for f in train_files), c.vocab_size, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train_ids = token_stream(tok, root, train_files).to(c.device)          # [N_train]
    held_ids = token_stream(tok, root, held_files).to(c.device)            # [N_held]
    print(f"corpus {root}: {len(train_files)} train files / {train_ids.numel():,} tokens, "
          f"{len(held_files)} held-out files / {held_ids.numel():,} tokens ({time.time() - t0:.0f}s)", flush=True)

    cfg_raw = model_config(c)
    cfg = ModelConfig.from_dict(cfg_raw)
    target, draft, moes, params = build_models(cfg, c)
    n_target = sum(p.numel() for p in target.parameters())
    n_mtp = sum(p.numel() for n, p in draft.named_parameters() if n.startswith("mtp."))
    print(f"parameters: target {n_target:,} + MTP layer {n_mtp:,} = {n_target + n_mtp:,} "
          f"(~{(n_target + n_mtp) * 2 / 2**20:.1f} MiB in bf16)", flush=True)
    decay = [p for p in params if p.ndim >= 2 and p is not target.model.embed_tokens.weight]
    no_decay = [p for p in params if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if c.device.startswith("cuda") else {}))
    step, tokens, train_s, evals = 0, 0, 0.0, []
    g = torch.Generator().manual_seed(c.seed + 17)
    deadline = t0 + c.max_minutes * 60 - c.reserve_s
    budget_s = max(deadline - time.time(), 1.0)
    if state:
        target.load_state_dict(state["target"]), draft.load_state_dict(state["draft"]), opt.load_state_dict(state["opt"])
        step, tokens, train_s, evals, budget_s = state["step"], state["tokens"], state["train_s"], state["evals"], state["budget_s"]
        g.set_state(state["rng"])
    fwd = torch.compile(forward_losses) if c.compile else forward_losses
    target.train(), draft.train()

    def save_work():
        torch.save(dict(target=target.state_dict(), draft=draft.state_dict(), opt=opt.state_dict(), step=step,
                        tokens=tokens, train_s=train_s, evals=evals, budget_s=budget_s, rng=g.get_state(), cfg=asdict(c)),
                   work / "last.pt")

    accum, recent = c.batch_size // c.micro_batch, []
    bar = tqdm(total=c.max_steps or None, initial=step, unit="step", dynamic_ncols=True, mininterval=2)
    last_save, t_log, tok_log = time.time(), time.time(), tokens
    while True:
        progress = max(train_s / budget_s, step / c.max_steps if c.max_steps else 0.0)
        if progress >= 1.0 or time.time() >= deadline:
            break
        t_step = time.time()
        lr = lr_at(step, progress, c)
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
        with torch.no_grad():  # noaux_tc balancing: under-loaded experts up, over-loaded down
            for m in moes:
                m.gate.e_score_correction_bias += c.bias_gamma * torch.sign(m.expert_load.mean() - m.expert_load)
                m.expert_load.zero_()
        step, tokens = step + 1, tokens + c.batch_size * c.seq_len
        recent = (recent + [torch.stack([main.detach(), mtp.detach(), gnorm.detach()])])[-50:]
        if step % c.log_every == 0:
            rm, rt, rg = torch.stack(recent).mean(0).tolist()
            now = time.time()
            bar.set_postfix(loss=f"{rm:.3f}", mtp=f"{rt:.3f}", gn=f"{rg:.2f}", lr=f"{lr:.1e}",
                            tok_s=f"{(tokens - tok_log) / (now - t_log):,.0f}", refresh=False)
            t_log, tok_log = now, tokens
        bar.update()
        train_s += time.time() - t_step
        if step % c.eval_every == 0:
            ev = evaluate(fwd, target, draft, held_ids, c, c.eval_seqs)
            rm, rt, _ = torch.stack(recent).mean(0).tolist()
            evals.append(dict(step=step, tokens=tokens, train_loss=rm, train_mtp_loss=rt, **ev))
            bar.write(f"step {step} tokens {tokens:,} train {rm:.3f}/{rt:.3f} held-out loss {ev['loss']:.3f} "
                      f"mtp {ev['mtp_loss']:.3f} mtp_acc {ev['mtp_acc']:.3f} agree {ev['mtp_agree_greedy']:.3f}")
        if time.time() - last_save > c.save_every_minutes * 60:
            save_work()
            last_save = time.time()
    bar.close()
    save_work()
    final = evaluate(fwd, target, draft, held_ids, c, 8 * c.eval_seqs)
    rm, rt, _ = torch.stack(recent).mean(0).tolist() if recent else (float("nan"),) * 3
    nbytes = export(target, draft, cfg_raw, out)
    log = dict(steps=step, tokens_seen=tokens, epochs=tokens / train_ids.numel(), final_train_loss=rm,
               final_train_mtp_loss=rt, heldout_loss=final["loss"], heldout_ppl=final["ppl"],
               heldout_mtp_loss=final["mtp_loss"], heldout_main_acc=final["main_acc"], heldout_mtp_acc=final["mtp_acc"],
               heldout_mtp_agree_greedy=final["mtp_agree_greedy"], heldout_eval_tokens=final["eval_tokens"],
               train_seconds=train_s, wall_seconds=time.time() - t0, tokens_per_s=tokens / max(train_s, 1e-9),
               params=dict(target=n_target, mtp_layer=n_mtp, total=n_target + n_mtp), checkpoint_bytes=nbytes,
               corpus=dict(root=str(root), python=sys.version.split()[0], train_files=len(train_files),
                           heldout_files=len(held_files), train_tokens=train_ids.numel(), heldout_tokens=held_ids.numel()),
               device=torch.cuda.get_device_name() if c.device.startswith("cuda") else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command="tandem train " + " ".join(argv),
               config=asdict(c), evals=evals)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: v for k, v in log.items() if k not in ("config", "evals")}, indent=1))
    return 0
