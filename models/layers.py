"""Building blocks: RMSNorm, rotary embedding (incl. YaRN), and the parallel linear layers.

Weights keep the checkpoint's [out, in] layout; each parameter records how it is sharded
(`shard_dim`) so the loader can read only this rank's slice.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels.rows import cpu_gemm_rows
from models.config import ModelConfig, yarn_get_mscale
from models.parallel import ParallelState, SINGLE, all_gather_cols, all_reduce


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = shard_param((dim,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps, pad=gemm_rows(x))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, RMSNorm(s)) for s = x + residual: a residual add and the norm after it (one launch on CUDA)."""
        return dispatch.rms_norm(x, self.weight, self.eps, residual, gemm_rows(x))


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (the V3.2 indexer's k_norm), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight, self.bias = shard_param((dim,)), shard_param((dim,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def shard_param(shape, shard=None, full_shape=None, dtype=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shard = shard                  # None: replicated; (dim, rank, size): this rank's slice along dim
    p.full_shape = tuple(full_shape or shape)
    return p


def linear_weight(module: nn.Module, shape, shard=None, full_shape=None, dtype=None, fp8: bool = False) -> None:
    """module.weight [out, in] (shard as shard_param); fp8: e4m3 with module.weight_scale_inv, one fp32 scale per
    128x128 block (kernels/fp8.py), split along the same dim, so a TP shard must be whole blocks."""
    from kernels.fp8 import BLOCK, FP8, blocks
    full = tuple(full_shape or shape)
    module.weight = shard_param(shape, shard, full, dtype=FP8 if fp8 else dtype)
    if not fp8:
        return
    if shard is not None and shard[2] > 1 and shape[shard[0]] % BLOCK:
        raise ValueError(f"fp8 weights in {BLOCK}x{BLOCK} blocks: the {shard[2]}-way shard of {full} along dim "
                         f"{shard[0]} is {shape[shard[0]]}, not a multiple of {BLOCK}")
    module.weight_scale_inv = shard_param(tuple(blocks(n) for n in shape), shard, tuple(blocks(n) for n in full),
                                          dtype=torch.float32)


LINEAR_ROWS = int(os.environ.get("TANDEM_LINEAR_ROWS", "128"))    # 0: off (to measure what it costs)


def gemm_rows(x: torch.Tensor) -> int:
    """Rows to give a buffer whose first rows feed dense_linear (0: as many as it has): LINEAR_ROWS on CUDA, so
    the GEMM takes the buffer as it is (a norm's or SwiGLU's output: kernels/triton_norm.padded), no copy."""
    return LINEAR_ROWS if x.is_cuda else 0


def cat_cols(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, -1); at inference, [N, *] rows land in the first rows of a gemm_rows buffer."""
    x = parts[0]
    if torch.is_grad_enabled() or x.dim() != 2:
        return torch.cat(parts, -1)
    out = torch.empty(max(x.shape[0], gemm_rows(x)), sum(p.shape[1] for p in parts), dtype=x.dtype, device=x.device)
    return torch.cat(parts, -1, out=out[:x.shape[0]])


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] . w [out, in] by cuBLAS. On CUDA a call of fewer than LINEAR_ROWS rows runs as LINEAR_ROWS
    rows: cuBLAS picks its kernel by row count, and an H200's bf16 GEMM at V2-Lite's dense MLP gives a row other
    bits among 32 rows than among 8 (BENCHMARKS.md "Lossless at any batch"), so without one class a verify
    row could part from its decode row at a near-tie; on a CPU 1 to 3 rows run as 4 (kernels/rows.gemm_ready).
    Rows never mix in a GEMM: padding rows change no other row. When x is the first rows of a contiguous buffer
    of that many rows or more (gemm_rows; buffer_rows finds it), the GEMM runs on that."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    least = LINEAR_ROWS if x.is_cuda else cpu_gemm_rows()        # CPU: 1-3 rows as 4 (kernels/rows.py)
    if not 0 < m < least or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return F.linear(x, w)
    rows = buffer_rows(x, least)
    if rows is None:
        rows = torch.empty(least, x.shape[-1], dtype=x.dtype, device=x.device)
        rows[:m].copy_(x.reshape(m, -1))
    return F.linear(rows, w)[:m].view(*x.shape[:-1], w.shape[0])


def buffer_rows(x: torch.Tensor, n: int) -> torch.Tensor | None:
    """[n, K] rows of x's storage from x's first row on, where x [..., K] is contiguous and its storage holds them
    (x the first rows of a gemm_rows buffer), else None. By storage, not by x._base: under torch.inference_mode, as
    the engines run, a view keeps no base. Rows past x's are only ever read, and no row mixes with another."""
    K = x.shape[-1]
    if not x.is_contiguous() or (x.storage_offset() + n * K) * x.element_size() > x.untyped_storage().nbytes():
        return None
    return x.as_strided((n, K), (K, 1))


def stacked(a: nn.Parameter, b: nn.Parameter) -> torch.Tensor:
    """[a; b] along dim 0 without a copy where b follows a in one storage (a MoE's stacked experts, or a stack made
    here before), else stacked now with a and b made views into it (the loader's in-place writes land there)."""
    x, y = a.data, b.data
    adjacent = (x.is_contiguous() and y.is_contiguous() and x.shape[1:] == y.shape[1:] and x.dtype == y.dtype
                and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                and y.data_ptr() == x.data_ptr() + x.numel() * x.element_size())
    if not adjacent:
        both = torch.cat([x, y])
        a.data, b.data = both[:x.shape[0]], both[x.shape[0]:]
        x = a.data
    return x.as_strided((x.shape[0] + y.shape[0], *x.shape[1:]), x.stride())


def fused(a: nn.Module, b: nn.Module) -> SimpleNamespace | None:
    """Two linear layers that read the same input, as one: their weights (and fp8 block scales) stacked [out_a +
    out_b, in] (see stacked), for linear(). None under autograd (training sees the parameters), for weights of
    two dtypes, or for fp8 where a's rows are not whole 128-row blocks."""
    fp8 = hasattr(a, "weight_scale_inv")
    if torch.is_grad_enabled() or a.weight.dtype != b.weight.dtype or fp8 != hasattr(b, "weight_scale_inv"):
        return None
    if not fp8:
        return SimpleNamespace(weight=stacked(a.weight, b.weight))
    from kernels.fp8 import BLOCK
    if a.weight.shape[0] % BLOCK:
        return None
    return SimpleNamespace(weight=stacked(a.weight, b.weight),
                           weight_scale_inv=stacked(a.weight_scale_inv, b.weight_scale_inv))


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in] -> [..., out] by module.weight (fp8 with its block scales: kernels.dispatch.fp8_linear)
    if hasattr(module, "weight_scale_inv"):
        return dispatch.fp8_linear(x, module.weight, module.weight_scale_inv)
    return dense_linear(x, module.weight)


class ReplicatedLinear(nn.Module):
    """The full matrix on every rank; `dtype` pins it (the V3.2 indexer's weights_proj stays fp32)."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState = SINGLE, dtype=None, fp8=False):
        super().__init__()
        linear_weight(self, (out_features, in_features), dtype=dtype, fp8=fp8)

    def forward(self, x):
        if hasattr(self, "weight_scale_inv"):
            return linear(self, x)
        return dense_linear(x.to(self.weight.dtype), self.weight)


class ColumnParallelLinear(nn.Module):
    """Output features split across TP ranks; each rank returns its slice (no collective)."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState = SINGLE, gather: bool = False,
                 fp8: bool = False):
        super().__init__()
        self.ps, self.gather = ps, gather
        linear_weight(self, (ps.shard(out_features, "out_features"), in_features), (0, ps.tp_rank, ps.tp_size),
                      (out_features, in_features), fp8=fp8)

    def forward(self, x):
        y = linear(self, x)
        return all_gather_cols(y, self.ps.tp_group, self.ps.tp_size) if self.gather else y


class RowParallelLinear(nn.Module):
    """Input features split across TP ranks; partial sums all-reduced unless `reduce=False`."""

    def __init__(self, in_features: int, out_features: int, ps: ParallelState = SINGLE, reduce: bool = True,
                 fp8: bool = False):
        super().__init__()
        self.ps, self.reduce = ps, reduce
        linear_weight(self, (out_features, ps.shard(in_features, "in_features")), (1, ps.tp_rank, ps.tp_size),
                      (out_features, in_features), fp8=fp8)

    def forward(self, x):
        y = linear(self, x)
        return all_reduce(y, self.ps.tp_group, self.ps.tp_size) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across TP ranks; out-of-shard ids give zeros, summed by all-reduce."""

    def __init__(self, vocab_size: int, dim: int, ps: ParallelState = SINGLE):
        super().__init__()
        self.ps = ps
        self.part = ps.shard(vocab_size, "vocab_size")
        self.start = ps.tp_rank * self.part
        self.weight = shard_param((self.part, dim), (0, ps.tp_rank, ps.tp_size), (vocab_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.part)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(y, self.ps.tp_group, self.ps.tp_size)


class ParallelLMHead(ColumnParallelLinear):
    """Vocabulary-parallel LM head; logits are all-gathered to the full vocabulary."""

    def __init__(self, dim: int, vocab_size: int, ps: ParallelState = SINGLE):
        super().__init__(dim, vocab_size, ps, gather=True)

    def forward(self, x):
        return super().forward(x).float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables per position; YaRN frequencies and magnitude as DeepSeek defines them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim, r = cfg.qk_rope_head_dim, cfg.rope
        self.interleave = cfg.rope_interleave
        inv_freq = 1.0 / (r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.attention_factor = 1.0
        if r.kind == "yarn":
            def corr_dim(rot):
                return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(r.theta))
            low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
            if r.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            high = high + 0.001 if low == high else high
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            extrapolate = 1 - ramp
            inv_freq = inv_freq / r.factor * (1 - extrapolate) + inv_freq * extrapolate
            self.attention_factor = yarn_get_mscale(r.factor, r.mscale) / yarn_get_mscale(r.factor, r.mscale_all_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, interleave: bool | None = None) -> torch.Tensor:
        # x: [N, H, R] rope part, positions: [N]; interleave: the layout (default: the config's; the V3.2
        # indexer always uses the half-split one)
        # DeepSeek's MLA layout pairs (x0, x1), (x2, x3), ...; the half-split one (x_i, x_{i+R/2})
        return dispatch.rotary(x, positions, self.inv_freq, self.attention_factor,
                               self.interleave if interleave is None else interleave)
