"""One entry point per kernel: the Triton kernel when its tensors are on CUDA and Triton imports, else the
PyTorch reference. Callers (services, models) import from here.

TANDEM_KERNELS=auto (default) | reference | triton forces the choice, read at each call: reference everywhere, or
Triton everywhere (an error if it does not import; CPU tensors need TRITON_INTERPRET=1 set before the kernels are
first imported: the interpreter, for tests). The two agree exactly (tests/test_triton_kernels.py), so the choice
changes speed, never tokens. The model's kernels (paged MLA attention, fused MoE: tests/test_model_kernels.py) follow
the same switch and agree with their references to rounding. TANDEM_ATTENTION=auto (default) | reference | triton |
flashinfer picks the attention backend on its own: auto is FlashInfer where it imports and covers the shapes, else
whatever TANDEM_KERNELS picks.

Prefill steps (eager, some request bringing more than PREFILL_MIN_ROWS query rows) take their own path:
TANDEM_PREFILL=auto (default) | off | absorbed | expanded. absorbed: the flash-style Triton kernel over the latent
cache (kernels/triton_mla_prefill.py); expanded: keys and values up-projected per head, then causal attention
(kernels/mla_expanded.py); off: the paged attention, as decode and verify steps. auto is PREFILL_AUTO on CUDA
wherever the attention backend is not the reference, off elsewhere. Decode, verify and CUDA-graph steps (a forced
AttentionBatch.attention_backend) never take it.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch

from kernels import dsa as _ref_dsa
from kernels import fp8 as _ref_fp8
from kernels import mla as _ref_mla
from kernels import norm as _ref_norm
from kernels import router as _ref_router
from kernels import rows as _ref_rows
from kernels import speculative as _ref_spec
from kernels.rows import gemm_ready, take_spans  # noqa: F401  (a CPU GEMM's rows; a slice or a gather: no kernels)
from kernels.speculative import argmax_rows, sampling_probs  # noqa: F401  (no Triton kernel: always the reference)

__all__ = ["sampling_probs", "rms_norm", "silu_mul", "rotary", "write_latent", "route", "greedy_accept",
           "rejection_sample", "pad_rows", "pad_shard_rows", "trim_rows", "index_scores", "sparse_mla",
           "paged_attention", "moe_path", "chain_verifier", "prefill_form", "prefill_attention", "expanded_attention",
           "fp8_linear", "attention_backend", "use_triton", "use_triton_forced", "triton_available", "mode"]

log = logging.getLogger("tandem.kernels")
ENV = "TANDEM_KERNELS"
MODES = ("auto", "reference", "triton")
_triton_ok: bool | None = None


def triton_available() -> bool:
    """Triton imports (checked once)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            importlib.import_module("triton")
            _triton_ok = True
        except Exception:  # ImportError, or a broken install (driver / compiler missing)
            _triton_ok = False
    return _triton_ok


def mode() -> str:
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def use_triton(x: torch.Tensor) -> bool:
    """Whether the kernel for main tensor x (the one that fixes the device) runs in Triton."""
    m = mode()
    if m == "reference":
        return False
    if m == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton does not import")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{ENV}=triton with {x.device} tensors needs TRITON_INTERPRET=1 (the interpreter)")
        return True
    return x.is_cuda and triton_available()


ATTENTION_ENV = "TANDEM_ATTENTION"
ATTENTION_MODES = ("auto", "reference", "triton", "flashinfer")


def attention_backend(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor) -> str:
    """'reference' | 'triton' | 'flashinfer' for the paged MLA attention over these tensors."""
    m = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if m not in ATTENTION_MODES:
        raise ValueError(f"{ATTENTION_ENV}={m!r}: expected one of {', '.join(ATTENTION_MODES)}")
    from kernels import flashinfer_mla
    if m == "flashinfer":
        if not flashinfer_mla.supported(q_lat, q_pe, ckv):
            raise RuntimeError(f"{ATTENTION_ENV}=flashinfer but flashinfer does not import or does not cover "
                               f"R={q_lat.shape[-1]}, P={q_pe.shape[-1]}, {q_lat.dtype} on {q_lat.device}")
        return m
    if m == "triton":
        use_triton_forced(q_lat)
        return m
    if m == "reference" or not use_triton(q_lat):
        return "reference"
    return "flashinfer" if flashinfer_mla.supported(q_lat, q_pe, ckv) else "triton"


def paged_attention(q_lat, q_pe, batch, ckv, kpe, scale: float, arrivals=None) -> torch.Tensor:
    """q_lat [N, h, R], q_pe [N, h, P] over one layer's paged cache (batch: a models.kv_cache.AttentionBatch) -> [N, h,
    R], on the batch's forced backend (graphs: triton) or attention_backend()'s; arrivals: PagedKVCache.arrivals."""
    backend = batch.attention_backend or attention_backend(q_lat, q_pe, ckv)
    if backend == "triton":
        from kernels.triton_mla import mla_attention_triton
        merged = arrivals if os.environ.get("TANDEM_ATTENTION_MERGE", "1").strip() != "0" else None   # 0: 2 launches
        return mla_attention_triton(q_lat, q_pe, ckv, kpe, batch.block_tables, batch.token_request,
                                    batch.positions, batch.context_lens, scale, arrivals=merged)
    if backend == "flashinfer":
        from kernels import flashinfer_mla
        if "flashinfer" not in batch.plans:          # once per step, shared by every layer
            ctx = [s + n for s, n in zip(batch.host_starts, batch.query_lens)]
            batch.plans["flashinfer"] = flashinfer_mla.plan(
                q_lat.device, batch.query_lens, ctx, batch.host_block_tables, q_lat.shape[1], q_lat.shape[2],
                q_pe.shape[2], batch.block_size, scale, q_lat.dtype)
        return flashinfer_mla.run(batch.plans["flashinfer"], q_lat, q_pe, ckv, kpe)
    return _ref_mla.latent_attention(q_lat, q_pe, batch, ckv, kpe, scale)


PREFILL_ENV = "TANDEM_PREFILL"
PREFILL_MODES = ("auto", "off", "absorbed", "expanded")
PREFILL_AUTO = "expanded"        # the faster form for long prompts (BENCHMARKS.md: tandem bench prefill-speed)
PREFILL_MIN_ROWS = 64            # a step is a prefill step when some request brings more query rows than this
_prefill_seen: set = set()


def prefill_form(q_pe: torch.Tensor, ckv: torch.Tensor, batch) -> str | None:
    """'absorbed' | 'expanded' for this step's dense attention, or None: paged_attention as for decode."""
    m = os.environ.get(PREFILL_ENV, "auto").strip().lower() or "auto"
    if m not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_ENV}={m!r}: expected one of {', '.join(PREFILL_MODES)}")
    if m == "off" or batch.attention_backend is not None or max(batch.query_lens, default=0) <= PREFILL_MIN_ROWS:
        return None
    form = m
    if m == "auto":
        q_lat = q_pe.new_empty(0, q_pe.shape[1], ckv.shape[-1])             # the absorbed query's shape
        form = PREFILL_AUTO if q_pe.is_cuda and attention_backend(q_lat, q_pe, ckv) != "reference" else None
    elif m == "absorbed":
        use_triton_forced(q_pe)
    if form not in _prefill_seen:                                            # said once per process and form
        _prefill_seen.add(form)
        log.info("prefill steps: %s attention (%s=%s)", form or "paged", PREFILL_ENV, m)
    return form


def prefill_attention(q_lat, q_pe, batch, ckv, kpe, scale: float) -> torch.Tensor:
    """The absorbed form of a prefill step (kernels/triton_mla_prefill.py): q_lat [N, h, R], q_pe [N, h, P]
    -> [N, h, R], as paged_attention."""
    tm = _mod("triton_mla_prefill")
    block_m = tm.block_sizes(q_lat.shape[1])[0]
    if ("prefill_tiles", block_m) not in batch.plans:      # once per step, shared by every layer
        batch.plans[("prefill_tiles", block_m)] = tm.plan_tiles(batch.query_lens, batch.host_starts,
                                                                block_m).to(q_lat.device)
    longest = max((s + n for s, n in zip(batch.host_starts, batch.query_lens)), default=0)
    return tm.mla_prefill_triton(q_lat, q_pe, ckv, kpe, batch.block_tables, batch.token_request, batch.positions,
                                 batch.context_lens, batch.plans[("prefill_tiles", block_m)], scale, longest)


def expanded_attention(q_nope, q_pe, batch, ckv, kpe, w_kv, scale: float) -> torch.Tensor:
    """The expanded form of a prefill step (kernels/mla_expanded.py): q_nope [N, h, nope], q_pe [N, h, P],
    w_kv [h, nope + v, R] -> [N, h, v]."""
    return _mod("mla_expanded").expanded_attention(q_nope, q_pe, batch, ckv, kpe, w_kv, scale)


def _inference(*ts: torch.Tensor) -> bool:
    """No gradient is wanted (the Triton kernels have no backward; training keeps the references)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pad: int = 0):
    """x [..., D], weight [D] -> RMSNorm(x); with residual: (s, RMSNorm(s)), s = x + residual (kernels/norm.py).
    One launch in Triton, whose outputs are the first rows of `pad`-row buffers (kernels/triton_norm.padded)."""
    if use_triton(x) and _inference(x, weight):
        return _mod("triton_norm").rms_norm(x, weight, eps, residual, pad)
    return _ref_norm.rms_norm(x, weight, eps) if residual is None else _ref_norm.add_rms_norm(x, residual, weight, eps)


def silu_mul(gu: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """gu [..., 2P] (gate | up) -> silu(gate) * up [..., P]; one launch in Triton (pad as rms_norm's)."""
    if use_triton(gu) and _inference(gu):
        return _mod("triton_norm").silu_mul(gu, pad)
    return _ref_norm.silu_mul(gu)


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float,
           interleave: bool) -> torch.Tensor:
    """x [N, H, R], positions [N] -> x turned by its positions (kernels/norm.py), one launch in Triton."""
    if use_triton(x) and _inference(x):
        return _mod("triton_norm").rotary(x, positions, inv_freq, factor, interleave)
    return _ref_norm.rotary(x, positions, inv_freq, factor, interleave)


ROUTER_ROWS = 128      # Triton's router logits up to here (decode and verify steps); above: cuBLAS


def write_latent(q_pe, kv_a, weight, eps: float, positions, inv_freq, factor: float, interleave: bool,
                 slot_mapping, ckv, kpe) -> torch.Tensor:
    """q_pe [N, h, P] turned -> returned; RMSNorm(c_kv) and k_pe turned (kv_a [N, R + P]) written into the cache at
    slot_mapping (kernels/mla.py); one launch in Triton where no value is rounded twice (the model's dtypes)."""
    args = (q_pe, kv_a, weight, eps, positions, inv_freq, factor, interleave, slot_mapping, ckv, kpe)
    fused = use_triton(kv_a) and _inference(kv_a, weight) and _mod("triton_mla_write").supported(q_pe, kv_a, weight,
                                                                                                    ckv, kpe)
    return (_mod("triton_mla_write").write_latent_triton if fused else _ref_mla.write_latent)(*args)


def router_logits(x: torch.Tensor, w: torch.Tensor):
    """x [N, D] . w [E, D] -> [N, E] fp32, each row's bits its own, in Triton for N <= ROUTER_ROWS (decode and
    verify steps; long prefills keep cuBLAS); None: the caller's reference."""
    if x.shape[0] <= ROUTER_ROWS and use_triton(x) and _inference(x, w):
        return _mod("triton_router").logits(x, w)
    return None


def route(logits: torch.Tensor, bias: torch.Tensor | None, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] fp32 -> (weights [N, k] fp32, expert ids [N, k]) (kernels/router.py), one launch in
    Triton where the shapes allow it."""
    if use_triton(logits) and _inference(logits):
        tr = _mod("triton_router")
        if tr.supported(logits.shape[-1], spec):
            return tr.select(logits, bias, spec)
    return _ref_router.select(logits, bias, spec)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., K], w [N, K] fp8 e4m3 with s [ceil(N/128), ceil(K/128)] block scales -> [..., N] in x's dtype
    (kernels/fp8.py: activations quantized per token per 128 columns); the small-M Triton GEMM on CUDA."""
    return (_mod("triton_fp8").fp8_linear_triton if use_triton(x) and _inference(x) else _ref_fp8.fp8_linear)(x, w, s)


def moe_path(x: torch.Tensor) -> str:
    """How a MoE layer runs its routed experts on x's device: 'triton' (the fused kernel: CUDA, or forced),
    'dense' (every local expert over every token, weighted: no host sync, graph-safe, CUDA without Triton)
    or 'loop' (tokens grouped per expert on the host: CPU)."""
    return "triton" if use_triton(x) else "dense" if x.is_cuda else "loop"


def chain_verifier(p: torch.Tensor, num_drafts: torch.Tensor, seeded: bool) -> str:
    """Who verifies sampled drafts: 'flashinfer' (its fused chain speculative sampling, TANDEM_VERIFIER=flashinfer,
    unseeded batches of equal K) or 'tandem' (rejection_sample below)."""
    from kernels import flashinfer_sampling
    return "flashinfer" if flashinfer_sampling.applies(p, num_drafts, seeded=seeded) else "tandem"


def use_triton_forced(x: torch.Tensor) -> None:
    """Raise unless a Triton kernel can run on x (compiled on CUDA, or interpreted)."""
    if not triton_available():
        raise RuntimeError("a Triton kernel was forced but triton does not import")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"a Triton kernel on {x.device} tensors needs TRITON_INTERPRET=1 (the interpreter)")


def _mod(name: str):                     # the Triton modules are imported on first use: triton is heavy
    return importlib.import_module(f"kernels.{name}")


def index_scores(q, w, k_cache, k_scale, block_tables, token_request, positions, context_lens, width: int):
    """V3.2 indexer scores over the paged key cache (kernels/dsa.py): q [N, H, D], w [N, H] -> [N, width]."""
    args = (q, w, k_cache, k_scale, block_tables, token_request, positions, context_lens, width)
    return _mod("triton_dsa").index_scores_triton(*args) if use_triton(q) else _ref_dsa.index_scores(*args)


def sparse_mla(q_lat, q_pe, ckv, kpe, block_tables, token_request, indices, scale: float, backend: str | None = None):
    """MLA over the selected keys only (kernels/dsa.py) -> [N, h, R]. `backend` as the dense attention's
    (AttentionBatch.attention_backend, else attention_backend()): 'reference' is PyTorch, any other Triton."""
    args = (q_lat, q_pe, ckv, kpe, block_tables, token_request, indices, scale)
    reference = (backend or attention_backend(q_lat, q_pe, ckv)) == "reference"
    return (_ref_dsa.sparse_mla if reference else _mod("triton_dsa").sparse_mla_triton)(*args)


def greedy_accept(logits: torch.Tensor, rows: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor):
    """logits [N, V], rows [B, K+1], drafts [B, K], num_drafts [B] -> (accepted | emitted [B, K+2], target)."""
    f = _mod("triton_speculative").greedy_accept_triton if use_triton(logits) else _ref_spec.greedy_accept
    return f(logits, rows, draft_ids, num_drafts)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     uniform: torch.Tensor, exp_noise: torch.Tensor):
    """p [B, K+1, V], q [B, K, V], draft_ids [B, K], num_drafts [B], uniform [B, K], exp_noise [B, V]
    -> accepted [B], emitted [B, K+1]."""
    f = _mod("triton_speculative").rejection_sample_triton if use_triton(p) else _ref_spec.rejection_sample
    return f(p, q, draft_ids, num_drafts, uniform, exp_noise)


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    # x: [N, D] -> [ceil(N / multiple) * multiple, D], zero rows appended
    return _mod("triton_rows").pad_rows_triton(x, multiple) if use_triton(x) else _ref_rows.pad_rows(x, multiple)


def pad_shard_rows(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    # x: [N, D] -> rank's [ceil(N / tp), D] of pad_rows(x, tp)
    return (_mod("triton_rows").pad_shard_rows_triton if use_triton(x) else _ref_rows.pad_shard_rows)(x, tp, rank)


def trim_rows(gathered: torch.Tensor, n: int) -> torch.Tensor:
    # gathered: [tp * S, D] -> [n, D] (the reference returns a view, the kernel a contiguous copy)
    return (_mod("triton_rows").trim_rows_triton if use_triton(gathered) else _ref_rows.trim_rows)(gathered, n)
