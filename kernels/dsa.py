"""DeepSeek sparse attention (DSA, V3.2): the lightning indexer's scores, top-k selection and sparse MLA
over the paged caches, as PyTorch references (kernels/triton_dsa.py computes the same on CUDA).

The indexer keeps one key per token per layer in a paged cache beside the MLA latent cache (same block
tables). For query row n of request b = token_request[n] at position pos = positions[n]:
    score[n, j] = k_scale[j] * sum_h w[n, h] * relu(q[n, h] . k[j])       for j < min(pos + 1, context_lens[b])
    score[n, j] = -inf                                                    for the other j < width
with every constant folded into w by the caller (weights_proj(x) * H^-1/2 * D^-1/2, and in deployed mode
the query's fp8 scale); k_scale is 1 in exact mode. The top min(topk, width) scores give the positions
the main attention of row n reads; a selected -inf (fewer causal keys than topk) is returned as -1.

Two scoring modes (models/indexer.py picks by the cache's key dtype):
  exact     q, k in the model's dtype, fp32 scores: transformers' DeepseekV32 (the CPU default).
  deployed  q, k rotated by a Hadamard transform (scale D^-1/2, orthogonal: exact dot products are
            unchanged) and quantized to fp8 e4m3 with one power-of-two scale per vector (DeepSeek's
            ue8m0 scheme; D <= 128, one block), as DeepSeek's kernels score (the GPU default).
"""
from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@functools.lru_cache(maxsize=8)
def _hadamard(dim: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    if dim & (dim - 1):
        raise ValueError(f"the indexer's Hadamard rotation needs a power-of-two head dim, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:                                   # Sylvester: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim ** -0.5).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    # x: [..., D] -> x H / sqrt(D), in x's dtype (computed in fp32)
    return (x.float() @ _hadamard(x.shape[-1], str(x.device), torch.float32)).to(x.dtype)


def quantize_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 e4m3 [..., D], fp32 scale [...]): scale = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    amax = x.float().abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _slots(block_tables, token_request, j: torch.Tensor, block_size: int) -> torch.Tensor:
    # rows n, positions j [W] -> flat slots [n, W]
    page = block_tables.long()[token_request.long()].gather(
        1, (j // block_size).clamp(max=block_tables.shape[1] - 1)[None].expand(token_request.shape[0], -1))
    return page * block_size + j % block_size


def _kv_len(positions, token_request, context_lens) -> torch.Tensor:
    return torch.minimum(positions.long() + 1, context_lens.long()[token_request.long()])     # [N]


def index_scores(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 block_tables: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                 context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """q [N, H, D] (model dtype, or fp8), w [N, H] fp32, k_cache [blocks, block_size, D] (model dtype, or
    fp8), k_scale [blocks, block_size] fp32 or None -> scores [N, width] fp32 (the rule above)."""
    N, H, D = q.shape
    bs = k_cache.shape[1]
    out = torch.full((N, width), float("-inf"), dtype=torch.float32, device=q.device)
    if N == 0 or width == 0:
        return out
    kflat = k_cache.reshape(-1, D)
    sflat = k_scale.reshape(-1) if k_scale is not None else None
    kv_len = _kv_len(positions, token_request, context_lens)
    j = torch.arange(width, device=q.device)
    chunk = max(1, (1 << 24) // max(1, width * max(D, H)))           # bounds the gathered keys per chunk
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        slots = _slots(block_tables, token_request[s:e], j, bs)                    # [n, W]
        k = kflat[slots].float()                                                   # [n, W, D]
        dots = torch.einsum("nhd,nwd->nhw", q[s:e].float(), k).relu_()              # [n, H, W]
        sc = torch.einsum("nh,nhw->nw", w[s:e].float(), dots)                      # [n, W]
        if sflat is not None:
            sc = sc * sflat[slots]
        out[s:e] = sc.masked_fill(j[None, :] >= kv_len[s:e, None], float("-inf"))
    return out


def topk_indices(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [N, W] -> [N, min(topk, W)] int32 positions of the largest scores, -1 where a pick is -inf."""
    vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)


def sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
               block_tables: torch.Tensor, token_request: torch.Tensor, indices: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q_lat [N, h, R], q_pe [N, h, P], ckv [blocks, bs, R], kpe [blocks, bs, P], indices [N, k] int32
    (positions of the row's request; -1: none) -> [N, h, R]: softmax((q_lat.c + q_pe.k_pe) * scale) c over
    the selected keys only, fp32 softmax; a row with no key gives zeros."""
    N, h, R = q_lat.shape
    P = q_pe.shape[-1]
    bs = ckv.shape[1]
    out = torch.zeros(N, h, R, dtype=q_lat.dtype, device=q_lat.device)
    if N == 0 or indices.shape[-1] == 0:
        return out
    cflat, kflat = ckv.reshape(-1, R), kpe.reshape(-1, P)
    chunk = max(1, (1 << 24) // max(1, indices.shape[1] * (R + P)))
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        idx = indices[s:e].long()                                                  # [n, k]
        valid = idx >= 0
        slots = torch.gather(block_tables.long()[token_request[s:e].long()], 1,
                             (idx.clamp(min=0) // bs).clamp(max=block_tables.shape[1] - 1)) * bs + idx.clamp(min=0) % bs
        c, kp = cflat[slots].to(q_lat.dtype), kflat[slots].to(q_pe.dtype)          # [n, k, R], [n, k, P]
        sc = (torch.einsum("nhr,nkr->nhk", q_lat[s:e], c) + torch.einsum("nhp,nkp->nhk", q_pe[s:e], kp)).float()
        sc = (sc * scale).masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.nan_to_num(sc.softmax(-1), nan=0.0).to(c.dtype)               # all -inf: zeros
        out[s:e] = torch.einsum("nhk,nkr->nhr", probs, c)
    return out
