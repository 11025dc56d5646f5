"""A step's MLA inputs in one Triton launch (issue 14: fewer launches a layer; reference: kernels/mla.py
`write_latent`): per query row n, at position pos = positions[n] and cache slot slot = slot_mapping[n],
    q_pe[n]           turned by pos (rotary, every head)                     -> a new [N, h, P] tensor
    c_kv = kv_a[n, :R]  -> RMSNorm(c_kv) * w                                 -> ckv[slot]
    k_pe = kv_a[n, R:]  turned by pos                                        -> kpe[slot]
Done eagerly these were five launches a layer (two rotaries, the norm and two index writes into the cache),
each 1-2 us at batch 1 and a gap in the graph; each value is computed as kernels/triton_norm.py's one-launch
kernels compute it (same formulas, a row's reduction on 4 warps), so the bits are theirs.

Two programs a row, side by side: _write_kernel grid (N, 2), the query's part and the cache's part. Padding rows
of a CUDA graph point at the scratch slot (their write lands there, models/attention.py). Runs compiled on CUDA
tensors, or on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_norm import rope_pairs


# positions and slots are read a value a program: no variant per alignment of them (a step's layout aligns every
# field, models/batch.aligned_parts; other callers need not)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _write_kernel(q_ptr, kv_ptr, w_ptr, pos_ptr, f_ptr, slot_ptr, qo_ptr, ckv_ptr, kpe_ptr,
                  s_qn, s_qh, s_kv, s_on, s_oh, s_c, s_k, H, R, HALF, eps, factor,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cos, sin, a, b, im = rope_pairs(pos_ptr, n, f_ptr, factor, HALF, BLOCK_P, INTERLEAVE)     # [BP] rope pairs
    if tl.program_id(1) == 0:                    # the query's rope part, every head: [BH, BP]
        h = tl.arange(0, BLOCK_H)
        qm = (h < H)[:, None] & im[None, :]
        q = q_ptr + n * s_qn + h[:, None].to(tl.int64) * s_qh
        qa = tl.load(q + a[None, :], mask=qm, other=0.0).to(tl.float32)
        qb = tl.load(q + b[None, :], mask=qm, other=0.0).to(tl.float32)
        o = qo_ptr + n * s_on + h[:, None].to(tl.int64) * s_oh
        qdt = qo_ptr.dtype.element_ty
        tl.store(o + a[None, :], (qa * cos[None, :] - qb * sin[None, :]).to(qdt), mask=qm)
        tl.store(o + b[None, :], (qa * sin[None, :] + qb * cos[None, :]).to(qdt), mask=qm)
    else:                                        # the latent, normed as _rms_norm_kernel; the key's rope part
        slot = tl.load(slot_ptr + n).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        rm = r < R
        x = tl.load(kv_ptr + n * s_kv + r, mask=rm, other=0.0).to(tl.float32)
        ka = tl.load(kv_ptr + n * s_kv + R + a, mask=im, other=0.0).to(tl.float32)
        kb = tl.load(kv_ptr + n * s_kv + R + b, mask=im, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r, mask=rm, other=0.0).to(tl.float32)
        xn = x * tl.rsqrt(tl.sum(x * x, 0) / R + eps)                            # fp32 sums, cast, then scaled
        y = w * xn.to(kv_ptr.dtype.element_ty).to(tl.float32)
        tl.store(ckv_ptr + slot * s_c + r, y.to(ckv_ptr.dtype.element_ty), mask=rm)
        kdt = kpe_ptr.dtype.element_ty
        tl.store(kpe_ptr + slot * s_k + a, (ka * cos - kb * sin).to(kdt), mask=im)
        tl.store(kpe_ptr + slot * s_k + b, (ka * sin + kb * cos).to(kdt), mask=im)

def supported(q_pe: torch.Tensor, kv_a: torch.Tensor, weight: torch.Tensor, ckv: torch.Tensor,
              kpe: torch.Tensor) -> bool:
    """One launch computes what the separate kernels would where no value is rounded twice: the norm's output
    dtype (promoted with its weight's) is the cache's, and the key's rope part keeps its dtype in the cache."""
    return (torch.promote_types(kv_a.dtype, weight.dtype) == ckv.dtype and kpe.dtype == kv_a.dtype
            and q_pe.stride(-1) == 1 and kv_a.stride(-1) == 1 and ckv.stride(-1) == 1 and kpe.stride(-1) == 1)


def write_latent_triton(q_pe: torch.Tensor, kv_a: torch.Tensor, weight: torch.Tensor, eps: float,
                        positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, interleave: bool,
                        slot_mapping: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    """q_pe [N, h, P], kv_a [N, R + P] (c_kv | k_pe), weight [R] -> q_pe turned [N, h, P]; RMSNorm(c_kv) and
    k_pe turned written into ckv [..., R] and kpe [..., P] at slot_mapping [N] (flat slots)."""
    N, H, P = q_pe.shape
    R = ckv.shape[-1]
    assert kv_a.shape == (N, R + P) and weight.shape == (R,), (tuple(kv_a.shape), tuple(weight.shape), R, P)
    c2, k2 = ckv.view(-1, R), kpe.view(-1, P)
    out = torch.empty(N, H, P, dtype=q_pe.dtype, device=q_pe.device)
    if N:
        _write_kernel[(N, 2)](q_pe, kv_a, weight, positions, inv_freq, slot_mapping, out, c2, k2,
                            q_pe.stride(0), q_pe.stride(1), kv_a.stride(0), out.stride(0), out.stride(1),
                            c2.stride(0), k2.stride(0), H, R, P // 2, eps, factor,
                            BLOCK_H=triton.next_power_of_2(H), BLOCK_R=triton.next_power_of_2(R),
                            BLOCK_P=triton.next_power_of_2(P // 2), INTERLEAVE=interleave, num_warps=4)
    return out
