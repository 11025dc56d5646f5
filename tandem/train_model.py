"""`tandem train`'s model side: building the trainable target + MTP layer, the losses, held-out scoring, export.

Loss: CE(next token) + mtp_lambda * CE(token t+2 from the final-norm hidden h[t] and embed(t+1)); the
MTP gradient flows into the main model (no detach), as in DeepSeek-V3, and the MTP layer shares the
target's embedding and LM head Parameters. With mtp_depths > 1 the MTP layer is also trained the way the
draft chains it when it proposes K tokens (services/draft/chain.py): depth d takes its own normed output of
depth d - 1 and embed(token t+d) and predicts token t+d+1 (teacher-forced tokens: a chained draft only
matters once the draft before it was accepted), weighted mtp_chain_lambda each. Routed experts run either
densely (every expert on every token, the gate zero off the top-k: three matmuls, E / k times the routed FLOPs)
or grouped (each token's k rows sorted by expert into groups padded to ALIGN rows, two grouped GEMMs): the same
function and gradients; neither syncs with the host.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from models.config import ModelConfig
from kernels.fp8 import quantize_weight
from models.loader import build, checkpoint_tensors, fp8_weight_names, save_checkpoint
from models.model import DraftModel, TargetModel
from models.moe import MoE
from models.presets import FP8 as FP8_FORMAT
from models.tiny import init_random_
from tandem.train_data import EOS, held_windows


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


ALIGN = 16  # rows per expert group a multiple of this: the grouped GEMM's tiles (bf16 on Hopper) want aligned groups


def grouped_moe_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    # x: [..., D] -> [..., D]; replaces MoE.forward on single-rank training modules; static shapes (compiles whole)
    shape, x = x.shape, x.reshape(-1, x.shape[-1])                         # [N, D]
    w, ids = self.gate(x)                                                  # [N, k] fp32, [N, k]
    (N, k), E = ids.shape, self.num_experts
    flat = ids.flatten()                                                   # [N*k] assignment n*k + j -> its expert
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    if self.training:
        self.expert_load += counts
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN                         # [E] each group's rows
    ends = padded.cumsum(0)                                                # [E] group ends (grouped GEMM offsets)
    order = flat.argsort(stable=True)                                      # [N*k] assignments by expert
    by = flat[order]                                                       # [N*k] their experts, ascending
    row = ends[by] - padded[by] + torch.arange(N * k, device=x.device) - (counts.cumsum(0) - counts)[by]
    pos = torch.empty_like(row).scatter_(0, order, row)                    # [N*k] each assignment's padded row
    P = N * k + E * ALIGN                                                  # padded rows: a static bound
    token = torch.arange(N * k, device=x.device) // k                      # [N*k] each assignment's token
    src = torch.full((P,), N, device=x.device).scatter_(0, pos, token)     # [P] each padded row's token
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    rows = F.pad(x.to(dt), (0, 0, 0, 1))[src]                              # [P, D]; padding rows read a zero row
    ex = [self.experts[str(e)] for e in range(E)]
    w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in ex]).to(dt)   # [E, 2I, D]
    w2 = torch.stack([m.down_proj.weight for m in ex]).to(dt)             # [E, D, I]
    offs = torch.cat([ends[:-1], ends.new_full((1,), P)]).to(torch.int32)  # the last group takes the spare zero rows
    g, u = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs).chunk(2, -1)                  # [P, I] each
    out = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)                         # [P, D]
    y = (out[pos].view(N, k, -1) * w.to(dt)[..., None]).sum(1)            # [N, D] weighted, summed in top-k order
    if hasattr(self, "shared_experts"):
        y = y + self.shared_experts(x)
    return y.view(shape)


MOE_FORWARD = dict(dense=dense_moe_forward, grouped=grouped_moe_forward)


def build_models(cfg: ModelConfig, c):
    """c: TrainConfig -> target, draft (sharing embedding and head), MoE modules, trainable parameters."""
    target = init_random_(build(TargetModel, cfg, device=c.device), c.seed).train()
    draft = init_random_(build(DraftModel, cfg, device=c.device), c.seed + 1).train()
    draft.embed_tokens.weight, draft.lm_head.weight = target.model.embed_tokens.weight, target.lm_head.weight  # shared
    if c.depth_init:  # each residual branch's output projection at std / sqrt(2 x layers): the sum keeps its scale
        with torch.no_grad():
            for name, p in itertools.chain(target.named_parameters(), draft.named_parameters()):
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_((2 * (cfg.num_hidden_layers + 1)) ** -0.5)
    params = list({id(p): p.requires_grad_(True) for p in itertools.chain(target.parameters(), draft.parameters())}.values())
    moes = [m for m in itertools.chain(target.modules(), draft.modules()) if isinstance(m, MoE)]
    for m in moes:  # the bias is moved by the load rule, never by gradients
        m.gate.e_score_correction_bias.requires_grad_(False).zero_()
        m.register_buffer("expert_load", torch.zeros(m.num_experts, device=c.device), persistent=False)
        m.forward = MOE_FORWARD[getattr(c, "moe", "dense")].__get__(m)
    return target, draft, moes, [p for p in params if p.requires_grad]


def forward_losses(target, draft, chunk: torch.Tensor, depths: int = 1, chain_rows: int = 0):
    """chunk: [B, T+1] -> main CE, [MTP CE of depth 1..depths], main logits [B, T, V], [MTP logits of depth d:
    [B_d, T-d, V], predicting token t+d+1]; depth 1 on all B rows, deeper depths on the first chain_rows (0: all)."""
    inp = chunk[:, :-1]                                                    # [B, T]
    h = target(inp, None, None)                                            # [B, T, D] final-norm hidden
    logits = target.compute_logits(h)                                      # [B, T, V] fp32
    main = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
    ces, mlogits, m = [], [], h
    for d in range(1, depths + 1):
        rows = chunk.shape[0] if d == 1 else (chain_rows or chunk.shape[0])
        m = draft(inp[:rows, d:], m[:rows, :-1], None, None)              # pairs (hidden[t], x[t+d]) -> [B_d, T-d, D]
        mlogits.append(draft.compute_logits(m))                            # [B_d, T-d, V]
        ces.append(F.cross_entropy(mlogits[-1].flatten(0, 1), chunk[:rows, d + 1:].flatten()))
    return main, ces, logits, mlogits


def autocast(device: str):
    return torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(target, draft, held: torch.Tensor, c, n_seqs: int, nbytes: torch.Tensor | None = None) -> dict:
    """Held-out loss / perplexity / bits per byte of the main model (token t+1) and of the MTP layer (t+2; with
    c.mtp_depths > 1 also the chained depths' top-1 accuracy on token t+d+1, full windows only), over n_seqs
    windows of c.seq_len + 1 tokens (0: the whole stream); nbytes [V]: bytes per token id."""
    depths, dev = getattr(c, "mtp_depths", 1), held.device
    chained = range(2, depths + 1)                                         # depth d predicts token t+d+1
    keys = ["nll", "mnll", "acc", "macc", "agree", "n", "n2", "bytes"] + [f"{k}_d{d}" for d in chained for k in ("acc", "n")]
    sums = dict.fromkeys(keys, torch.zeros((), dtype=torch.float64, device=dev))
    target.eval(), draft.eval()
    for _, same in itertools.groupby(held_windows(held, c.seq_len, n_seqs), key=len):
        same = list(same)
        for i in range(0, len(same), c.micro_batch):
            chunk = torch.stack(same[i: i + c.micro_batch])                 # [b, T+1]
            full = chunk.shape[1] == c.seq_len + 1
            with autocast(c.device):
                _, _, logits, mlogits = forward_losses(target, draft, chunk, depths if full else 1)
            y, y2 = chunk[:, 1:], chunk[:, 2:]
            pred, mpred = logits.argmax(-1), mlogits[0].argmax(-1)  # [b, T], [b, T-1]; MTP vs true t+2 and greedy t+1
            got = dict(nll=F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"),
                       mnll=F.cross_entropy(mlogits[0].float().flatten(0, 1), y2.flatten(), reduction="sum"),
                       acc=(pred == y).sum(), macc=(mpred == y2).sum(), agree=(mpred == pred[:, 1:]).sum(),
                       n=y.numel(), n2=y2.numel(), bytes=nbytes.to(dev)[y].sum() if nbytes is not None else 0)
            for d, ml in enumerate(mlogits[1:], start=2):                  # [b, T-d, V]
                got[f"acc_d{d}"], got[f"n_d{d}"] = (ml.argmax(-1) == chunk[:, d + 1:]).sum(), ml.shape[0] * ml.shape[1]
            for k, v in got.items():
                sums[k] = sums[k] + v
    target.train(), draft.train()
    s = {k: float(v) for k, v in sums.items()}
    chain = {f"mtp{d}_acc": s[f"acc_d{d}"] / max(s[f"n_d{d}"], 1) for d in chained}
    per_byte = {} if nbytes is None else dict(bits_per_byte=s["nll"] / math.log(2) / s["bytes"], eval_bytes=int(s["bytes"]))
    return dict(loss=s["nll"] / s["n"], ppl=math.exp(s["nll"] / s["n"]), mtp_loss=s["mnll"] / s["n2"],
                main_acc=s["acc"] / s["n"], mtp_acc=s["macc"] / s["n2"], mtp_agree_greedy=s["agree"] / s["n2"],
                eval_tokens=int(s["n"]), **chain, **per_byte)


def export(target, draft, cfg_raw: dict, out: Path, fp8: bool = False) -> int:
    """HF layout in bf16; the MTP layer's embed_tokens / shared_head.head are left out (the loader falls back).
    fp8: the weights an fp8 model keeps in fp8 stored as DeepSeek publishes V3 (e4m3, a weight_scale_inv per
    128x128 block, config.json's quantization_config), quantized from their bf16 export: the checkpoint is the bf16
    one as `--quantization fp8` serves it, in about half the bytes. -> bytes written."""
    L = cfg_raw["num_hidden_layers"]
    tensors = {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
               for k, v in checkpoint_tensors(target, draft).items()
               if k not in (f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight")}
    if fp8:
        cfg_raw = {**cfg_raw, **FP8_FORMAT}
        keep = fp8_weight_names(ModelConfig.from_dict(cfg_raw))
        tensors = dict(itertools.chain.from_iterable(
            zip((k, k + "_scale_inv"), quantize_weight(v)) if k in keep else [(k, v)] for k, v in tensors.items()))
    [f.unlink() for f in [*out.glob("*.safetensors"), *out.glob("model.safetensors.index.json")]]   # stale shards
    save_checkpoint(tensors, out, max_shard_bytes=(16 << 20) - (64 << 10))   # each file <= 16 MiB with its header
    (out / "config.json").write_text(json.dumps(cfg_raw, indent=1))
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=1, eos_token_id=EOS, do_sample=False)))
    return sum(t.numel() * t.element_size() for t in tensors.values())
