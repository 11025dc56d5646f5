"""Dense MLP and DeepSeek MoE: sigmoid router with noaux_tc grouped top-k, routed and shared experts.

Parallel layout: the tp ranks form ep expert groups of etp = tp / ep ranks each. A group holds
n_routed_experts / ep experts, each split etp ways along its intermediate dim. Shared experts and
dense MLPs are split tp ways. Every rank adds its partial outputs; one all-reduce completes them.

Routed experts run on one of three paths (kernels.dispatch.use_triton, TANDEM_KERNELS): the fused
Triton MoE (kernels/triton_moe.py; CUDA, or the interpreter in tests), which reads this rank's experts
stacked as w13 [E_local, 2I, D] / w2 [E_local, D, I] and never syncs with the host; on CPU the
reference loop over the experts that received tokens; on CUDA without Triton a dense loop over every
local expert (slow, but with no host sync either). The router computes in fp32, autocast or not. The fused
kernels read this rank's shared experts in place as more experts that every token takes (`shared_for_kernels`):
no launches of their own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch, moe_tiles
from kernels.router import RouteSpec
from models.config import ModelConfig
from models.layers import dense_linear, fused, gemm_rows, linear, linear_weight, shard_param
from models.parallel import ParallelState, SINGLE, all_reduce


class MLP(nn.Module):
    """SwiGLU MLP, column-split gate/up and row-split down over `size` ranks (no collective here); fp8: each
    projection holds e4m3 weights and 128x128 block scales (models/layers.linear_weight)."""

    def __init__(self, dim: int, inter: int, rank: int = 0, size: int = 1, fp8: bool = False):
        super().__init__()
        if inter % size:
            raise ValueError(f"intermediate size {inter} is not divisible by {size} ranks")
        part = inter // size
        self.gate_proj = _Weight((part, dim), (0, rank, size), (inter, dim), fp8)
        self.up_proj = _Weight((part, dim), (0, rank, size), (inter, dim), fp8)
        self.down_proj = _Weight((dim, part), (1, rank, size), (dim, inter), fp8)

    def forward(self, x):
        # x: [N, D] -> [N, D]; gate and up as one GEMM ([gate | up] rows: layers.fused) and one silu-times-up launch
        gate_up = fused(self.gate_proj, self.up_proj)
        if gate_up is None:
            return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))
        return linear(self.down_proj, dispatch.silu_mul(linear(gate_up, x), gemm_rows(x)))


class _Weight(nn.Module):
    def __init__(self, shape, shard, full_shape, fp8: bool):
        super().__init__()
        linear_weight(self, shape, shard, full_shape, fp8=fp8)


class DenseMLP(MLP):
    """MLP of a dense layer: gate/up column-parallel, down row-parallel, then the TP all-reduce."""

    def __init__(self, dim: int, inter: int, ps: ParallelState = SINGLE, fp8: bool = False):
        super().__init__(dim, inter, ps.tp_rank, ps.tp_size, fp8)
        self.ps = ps

    def forward(self, x):
        return all_reduce(super().forward(x), self.ps.tp_group, self.ps.tp_size)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [N, D], weight: [E, D] -> [N, E] fp32 (DeepSeek routes in fp32, autocast or not). A decode row must route
    # exactly as the same row of a verify step of any batch, where a near-tie between experts could otherwise go
    # the other way: on CUDA a Triton kernel sums each row alone (kernels/triton_router.logits, up to 128 rows);
    # without Triton cuBLAS runs them as one class of rows (models/layers.dense_linear), since its fp32 GEMM picks
    # its kernel by row count (an H200: one row's sums differ in the last bit from two rows', BENCHMARKS.md).
    fast = dispatch.router_logits(x, weight)
    if fast is not None:
        return fast
    with torch.autocast(x.device.type, enabled=False):
        return dense_linear(x.float(), weight.float())       # no copy where x is fp32 already (CPU, prefill)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.cfg = cfg
        self.spec = RouteSpec(sigmoid=cfg.scoring_func == "sigmoid", n_group=max(cfg.n_group, 1),
                              topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                              noaux=cfg.topk_method == "noaux_tc", norm=cfg.norm_topk_prob,
                              scale=cfg.routed_scaling_factor)
        self.weight = shard_param((E, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = shard_param((E,))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, D] -> weights [N, k] (fp32), expert ids [N, k]
        logits = router_logits(x, self.weight)
        bias = getattr(self, "e_score_correction_bias", None)   # in fp32 where it is used (no cast launch here)
        return dispatch.route(logits, bias, self.spec)          # kernels/router.py: the rule


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState = SINGLE):
        super().__init__()
        E, tp, ep = cfg.n_routed_experts, ps.tp_size, ps.ep_size
        if ep < 1 or tp % ep:
            raise ValueError(f"ep ({ep}) must divide tp ({tp})")
        if E % ep:
            raise ValueError(f"n_routed_experts ({E}) is not divisible by ep ({ep})")
        self.ps, self.num_experts = ps, E
        self.reduce = True                     # False under SP: the caller reduce-scatters instead
        etp = tp // ep
        group, sub = ps.tp_rank // etp, ps.tp_rank % etp
        self.local = range(group * (E // ep), (group + 1) * (E // ep))
        self.gate = Router(cfg)
        self.fp8 = cfg.quantization == "fp8"
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size, sub, etp, self.fp8)
                                      for e in self.local})
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      ps.tp_rank, tp, self.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D] (identical on every TP rank) -> [..., D]
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(x)                               # [N, k]
        y = self.routed(x, weights, ids)                          # routed + shared
        if self.reduce:                                           # EP combine + TP reduce, one call
            y = all_reduce(y, self.ps.tp_group, self.ps.tp_size)
        return y.view(shape)

    def routed(self, x, weights, ids) -> torch.Tensor:
        # x: [N, D], weights: [N, k] fp32, ids: [N, k] global expert ids -> [N, D]: this rank's experts and its
        # share of the shared experts (read by the fused kernels in place, or added in their last launch)
        path = dispatch.moe_path(x)
        shared = getattr(self, "shared_experts", None)
        if path == "triton":
            inside = self.shared_for_kernels(x.shape[0])
            add = shared(x) if shared is not None and inside is None else None
            if self.fp8:
                from kernels.triton_fp8_moe import fused_moe_fp8_triton
                return fused_moe_fp8_triton(x, *self.prepare_for_kernels(), weights, ids, self.local.start, add=add,
                                            shared=inside)
            from kernels.triton_moe import fused_moe_triton
            w13, w2 = self.prepare_for_kernels()
            return fused_moe_triton(x, w13, w2, weights, ids, self.local.start, add=add, shared=inside)
        y = self._routed_dense(x, weights, ids) if path == "dense" else self._routed_loop(x, weights, ids)
        return y if shared is None else y + shared(x)

    def shared_for_kernels(self, tokens: int) -> tuple[torch.Tensor, ...] | None:
        """This rank's shared experts as the fused kernels read them in a call of `tokens` tokens, (sw13 [2S, D]
        (gate rows, then up: a view, models/layers.fused), sw2 [D, S]), fp8 with their block scales (sw13, ss13, sw2,
        ss2); None (added after the kernels instead) where kernels/moe_tiles.shared_inside says not at this size,
        where their intermediate rows here (S) are not whole routed experts' (I: n_shared_experts / ep not whole),
        where fp8 blocks do not align, or under autograd."""
        m = getattr(self, "shared_experts", None)
        if m is None:
            return None
        I, S = self.experts[str(self.local.start)].gate_proj.weight.shape[0], m.gate_proj.weight.shape[0]
        if S % I or not moe_tiles.shared_inside(tokens, self.gate.spec.top_k, S // I, len(self.local)):
            return None
        gate_up = fused(m.gate_proj, m.up_proj)
        if gate_up is None or self.fp8 and I % 128:
            return None
        if self.fp8:
            return gate_up.weight, gate_up.weight_scale_inv, m.down_proj.weight, m.down_proj.weight_scale_inv
        return gate_up.weight, m.down_proj.weight

    def _routed_loop(self, x, weights, ids) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()     # CPU: no device to wait on
        token = order // k
        w = weights.flatten()[order].to(x.dtype)
        y = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n and e in self.local:
                rows = token[start:start + n]
                y.index_add_(0, rows, self.experts[str(e)](x[rows]) * w[start:start + n, None])
            start += n
        return y

    def _routed_dense(self, x, weights, ids) -> torch.Tensor:
        # every local expert over every token, weighted by its routing weight (0 if not chosen)
        y = torch.zeros_like(x)
        for e in self.local:
            w = (weights * (ids == e)).sum(-1).to(x.dtype)                       # [N]
            y = y + self.experts[str(e)](x) * w[:, None]
        return y

    def prepare_for_kernels(self) -> tuple[torch.Tensor, ...]:
        """This rank's experts stacked: w13 [E_local, 2I, D] (gate rows, then up), w2 [E_local, D, I]; fp8:
        (w13, s13 [E_local, 2 ceil(I/128), ceil(D/128)] (gate blocks, then up's), w2, s2 [E_local, ceil(D/128),
        ceil(I/128)]), kernels/triton_fp8_moe.py's layout.

        Built on first use; the per-expert parameters then become views into them, so there is one
        copy of the weights and the loader's in-place writes land in the stacked tensors. If the
        parameters were replaced since (module.to(), .data assignment), they are stacked again.
        Call it once before CUDA-graph capture (warm-up does). models/loader.save_checkpoint gives each
        view its own storage, as safetensors needs."""
        experts = [self.experts[str(e)] for e in self.local]
        first, last = experts[0], experts[-1]
        st = getattr(self, "_stacked", None)
        if (st is None or first.gate_proj.weight.data_ptr() != st[0].data_ptr()
                or last.down_proj.weight.data_ptr() != st[-2 if self.fp8 else -1][-1].data_ptr()):
            names = ("weight", "weight_scale_inv") if self.fp8 else ("weight",)
            st = []
            for attr in names:
                gate, up, down = ([getattr(getattr(m, p), attr) for m in experts]
                                  for p in ("gate_proj", "up_proj", "down_proj"))
                rows = gate[0].shape[0]
                w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
                w2 = torch.stack(down)
                for i, m in enumerate(experts):
                    getattr(m.gate_proj, attr).data = w13[i, :rows]
                    getattr(m.up_proj, attr).data = w13[i, rows:]
                    getattr(m.down_proj, attr).data = w2[i]
                st.append((w13, w2))
            self._stacked = st = tuple(t for pair in zip(*st) for t in pair) if self.fp8 else st[0]
        return st
