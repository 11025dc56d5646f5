"""FlashInfer's paged MLA kernel (flashinfer.mla.BatchMLAPagedAttentionWrapper, the 0.5 API) behind the
interface of kernels/triton_mla.py: absorbed q_lat [N, h, R] and q_pe [N, h, P] over the latent cache
ckv [blocks, block_size, R], kpe [blocks, block_size, P] -> [N, h, R].

`plan` runs once per step on host metadata (it copies the layout to the device and builds FlashInfer's
work schedule; it reads host tensors, so it must run OUTSIDE any CUDA-graph capture); `run` is then
called by every layer with that plan. Causal masking is bottom-right aligned (query i of a request with
q queries and L keys sees keys <= L - q + i), which is Tandem's layout: the new tokens are the last
q of the request's context. Used only where FlashInfer imports and the shapes are the ones its MLA
kernels are built for (R = 512, P = 64, fp16 / bf16); otherwise the Triton kernel serves.
"""
from __future__ import annotations

import importlib

import torch

WORKSPACE_BYTES = 128 << 20          # FlashInfer's recommended split-k workspace
_mla = None                          # the flashinfer.mla module, or False when it does not import
_workspaces: dict[torch.device, torch.Tensor] = {}


def _module():
    global _mla
    if _mla is None:
        try:
            _mla = importlib.import_module("flashinfer.mla")
        except Exception:   # not installed, or no CUDA toolchain / driver for its JIT
            _mla = False
    return _mla


def available() -> bool:
    return bool(_module())


def supported(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor) -> bool:
    """FlashInfer imports and its MLA kernels cover these tensors."""
    return (q_lat.is_cuda and q_lat.shape[-1] == 512 and q_pe.shape[-1] == 64
            and q_lat.dtype in (torch.float16, torch.bfloat16) and ckv.dtype == q_lat.dtype and available())


def plan(device: torch.device, query_lens: list[int], context_lens: list[int], host_block_tables: torch.Tensor,
         num_heads: int, rank: int, rope_dim: int, block_size: int, scale: float, dtype: torch.dtype):
    """A planned wrapper for one step. query_lens / context_lens [B] host ints (context after the step),
    host_block_tables [B, max_blocks] CPU int32. Not capturable: call before a graph replay."""
    mla = _module()
    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = mla.BatchMLAPagedAttentionWrapper(_workspaces[device], backend="auto")
    B = len(query_lens)
    qo_indptr = torch.zeros(B + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    kv_len = torch.tensor(context_lens, dtype=torch.int32)
    pages = (kv_len + block_size - 1) // block_size                         # [B] pages each request uses
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = pages.cumsum(0)
    kv_indices = torch.cat([host_block_tables[b, : int(pages[b])] for b in range(B)]).to(torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices.to(device), kv_len, num_heads, rank, rope_dim, block_size,
                 True, scale, dtype, dtype)
    return wrapper


def run(wrapper, q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    # q_lat: [N, h, R], q_pe: [N, h, P], ckv: [blocks, block_size, R], kpe: [blocks, block_size, P] -> [N, h, R]
    return wrapper.run(q_lat.contiguous(), q_pe.contiguous(), ckv, kpe)
