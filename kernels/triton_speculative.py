"""Triton kernels of the acceptance math: greedy acceptance (argmax, verification) and lossless rejection sampling.

Same signatures, semantics and outputs as kernels/speculative.py (the reference they are tested
against): accepted [B] int64, emitted [B, K+1] padded with -1 after the accepted + 1 valid tokens (greedy
acceptance returns them side by side, [B, K+2], after each row's argmax in chunks spread over the GPU).
One program per request. The K draft positions are tested as one vector (K is small): the accepted
length is the first position that fails, found with a min-reduction (position K always fails, so
accepted <= K). Rejection sampling then runs the exponential race argmax(w / E) over V in blocks,
for the residual max(0, p_a - q_a) and for p_a at once, so p, q and E are read once.

Runs compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, s_xm, V, C, CHUNK: tl.constexpr):
    # program (m, c): the max of row m's chunk c (CHUNK logits) and its first index, as a global column
    m, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    col = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + m * s_xm + col, mask=col < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, col, V), 0)                # the first column holding the max
    tl.store(val_ptr + m * C + c, best)
    tl.store(idx_ptr + m * C + c, first.to(tl.int64))


# the drafts, their counts and the logit rows are slices of one packed upload (services/target/verify_io.py), aligned
# or not by the batch's size: not specialized on it, so a batch of a new size does not compile mid-serving
@triton.jit(do_not_specialize_on_alignment=["row_ptr", "draft_ptr", "nd_ptr"])
def _greedy_accept_kernel(val_ptr, idx_ptr, row_ptr, draft_ptr, nd_ptr, out_ptr, tgt_ptr,
                          s_rb, s_rk, s_db, s_dk, s_ob, s_ok, s_tb, s_tk, K, C,
                          BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_K)                                   # verified positions 0 .. K (< BLOCK_K)
    c = tl.arange(0, BLOCK_C)
    row = tl.load(row_ptr + b * s_rb + pos * s_rk, mask=pos <= K, other=0)        # each position's logit row
    vm = (pos <= K)[:, None] & (c < C)[None, :]
    v = tl.load(val_ptr + row[:, None] * C + c[None, :], mask=vm, other=float("-inf"))   # [BK, BC] chunk maxima
    first = tl.min(tl.where((v == tl.max(v, 1)[:, None]) & vm, c[None, :], BLOCK_C), 1)  # first chunk with the max
    tgt = tl.load(idx_ptr + row * C + first, mask=pos <= K, other=0)              # the row's argmax
    n = tl.load(nd_ptr + b)
    d = tl.load(draft_ptr + b * s_db + pos * s_dk, mask=pos < K, other=0)
    ok = (d == tgt) & (pos < n) & (pos < K)
    a = tl.min(tl.where(ok, BLOCK_K, pos), 0)                     # first failing position: accepted
    tl.store(out_ptr + b * s_ob, a.to(tl.int64))
    tl.store(out_ptr + b * s_ob + (pos + 1) * s_ok, tl.where(pos <= a, tgt, -1), mask=pos <= K)
    tl.store(tgt_ptr + b * s_tb + pos * s_tk, tgt, mask=pos <= K)


def greedy_accept_triton(logits: torch.Tensor, rows: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor):
    """logits [N, V], rows [B, K+1] (each verified position's logit row), draft_ids [B, K], num_drafts [B] ->
    (accepted | emitted [B, K+2] int64, target [B, K+1]) as kernels.speculative.greedy_accept: two launches, each
    row's chunk maxima over the GPU, then per request the argmax of its positions' rows and the longest prefix."""
    (N, V), (B, K) = logits.shape, draft_ids.shape
    dev, CHUNK = logits.device, 1024
    C = triton.cdiv(V, CHUNK)
    vals = torch.empty(N, C, dtype=torch.float32, device=dev)
    idx = torch.empty(N, C, dtype=torch.long, device=dev)
    out = torch.empty(B, K + 2, dtype=torch.long, device=dev)
    target = torch.empty(B, K + 1, dtype=torch.long, device=dev)
    if B and N:
        assert logits.stride(1) == 1
        _chunk_max_kernel[(N, C)](logits, vals, idx, logits.stride(0), V, C, CHUNK=CHUNK, num_warps=4)
        _greedy_accept_kernel[(B,)](vals, idx, rows, draft_ids, num_drafts, out, target, *rows.stride(),
                                    *draft_ids.stride(), *out.stride(), *target.stride(), K, C,
                                    BLOCK_K=triton.next_power_of_2(K + 1), BLOCK_C=triton.next_power_of_2(C),
                                    num_warps=1)
    return out, target


@triton.jit(do_not_specialize_on_alignment=["draft_ptr", "nd_ptr"])     # as _greedy_accept_kernel's
def _rejection_sample_kernel(p_ptr, q_ptr, draft_ptr, nd_ptr, u_ptr, e_ptr, acc_ptr, out_ptr,
                             s_pb, s_pk, s_pv, s_qb, s_qk, s_qv, s_db, s_dk, s_ub, s_uk, s_eb, s_ev,
                             s_ob, s_ok, K, V, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             V_BLOCKS: tl.constexpr, HAS_Q: tl.constexpr):
    # V_BLOCKS = cdiv(V, BLOCK_V) is constexpr: the interpreter cannot loop to a runtime bound
    b = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_K)                                   # positions 0 .. K (< BLOCK_K)
    n = tl.load(nd_ptr + b)
    # accept d_i while u_i * q_i(d_i) <= p_i(d_i) and i < num_drafts  (probability min(1, p/q))
    d = tl.load(draft_ptr + b * s_db + pos * s_dk, mask=pos < K, other=0).to(tl.int64)
    live = (pos < K) & (d >= 0) & (d < V)                         # an id outside [0, V) is rejected
    p_d = tl.load(p_ptr + b * s_pb + pos * s_pk + d * s_pv, mask=live, other=0.0).to(tl.float32)
    q_d = tl.zeros([BLOCK_K], tl.float32)
    if HAS_Q:
        q_d = tl.load(q_ptr + b * s_qb + pos * s_qk + d * s_qv, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + b * s_ub + pos * s_uk, mask=live, other=1.0).to(tl.float32)
    ok = live & (u * q_d <= p_d) & (pos < n)
    a = tl.min(tl.where(ok, BLOCK_K, pos), 0).to(tl.int64)        # accepted, in [0, K]
    rejected = a < n
    qa = tl.minimum(a, K - 1)                                     # q row of the rejected position
    p_row = p_ptr + b * s_pb + a * s_pk
    q_row = q_ptr + b * s_qb + qa * s_qk
    e_row = e_ptr + b * s_eb
    # exponential race over V: argmax(w / E) samples norm(w); first index wins ties (torch.argmax)
    best_p = tl.full([], float("-inf"), tl.float32)               # w = p_a (bonus, or p == q fallback)
    arg_p = tl.full([], 0, tl.int64)
    best_r = tl.full([], float("-inf"), tl.float32)               # w = max(0, p_a - q_a)
    arg_r = tl.full([], 0, tl.int64)
    any_r = tl.full([], 0, tl.int32)                              # residual has mass (sum > 0)
    for blk in range(V_BLOCKS):
        v0 = blk * BLOCK_V
        offs = v0 + tl.arange(0, BLOCK_V)
        mv = offs < V
        pv = tl.load(p_row + offs * s_pv, mask=mv, other=0.0).to(tl.float32)
        ev = tl.load(e_row + offs * s_ev, mask=mv, other=1.0).to(tl.float32)
        s = tl.where(mv, tl.math.div_rn(pv, ev), float("-inf"))  # div_rn: IEEE division, as torch
        m = tl.max(s, 0)
        i = tl.argmax(s, 0).to(tl.int64)
        arg_p = tl.where(m > best_p, v0 + i, arg_p)
        best_p = tl.maximum(m, best_p)
        if HAS_Q:
            qv = tl.load(q_row + offs * s_qv, mask=mv, other=0.0).to(tl.float32)
            r = tl.maximum(pv - qv, 0.0)
            any_r = tl.maximum(any_r, tl.max((mv & (r > 0)).to(tl.int32), 0))
            s = tl.where(mv, tl.math.div_rn(r, ev), float("-inf"))
            m = tl.max(s, 0)
            i = tl.argmax(s, 0).to(tl.int64)
            arg_r = tl.where(m > best_r, v0 + i, arg_r)
            best_r = tl.maximum(m, best_r)
    last = tl.where(rejected & (any_r > 0), arg_r, arg_p)
    out = tl.where(pos < a, d, tl.where(pos == a, last, -1))
    tl.store(acc_ptr + b, a)
    tl.store(out_ptr + b * s_ob + pos * s_ok, out, mask=pos <= K)


def rejection_sample_triton(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                            uniform: torch.Tensor, exp_noise: torch.Tensor, block_v: int = 1024):
    """p [B, K+1, V], q [B, K, V], draft_ids [B, K], num_drafts [B], uniform [B, K], exp_noise [B, V]
    -> accepted [B], emitted [B, K+1] (kernels.speculative.rejection_sample). Arithmetic in float32
    (the reference computes in p's dtype; the engines pass float32). Small inputs move to p's device."""
    B, K = draft_ids.shape
    V = p.shape[-1]
    assert p.shape == (B, K + 1, V) and q.shape == (B, K, V), (tuple(p.shape), tuple(q.shape))
    dev = p.device
    draft_ids, num_drafts, uniform, exp_noise = (t.to(dev) for t in (draft_ids, num_drafts, uniform, exp_noise))
    q = q.to(dev) if K else p                                    # K = 0: q is never read (HAS_Q off)
    accepted = torch.empty(B, dtype=torch.long, device=dev)
    emitted = torch.empty(B, K + 1, dtype=torch.long, device=dev)
    if B:
        block_v = min(block_v, triton.next_power_of_2(V))
        uk = uniform.stride() if K else (0, 0)
        _rejection_sample_kernel[(B,)](p, q, draft_ids, num_drafts, uniform, exp_noise, accepted, emitted,
                                       *p.stride(), *q.stride(), *draft_ids.stride(), *uk, *exp_noise.stride(),
                                       *emitted.stride(), K, V, BLOCK_K=triton.next_power_of_2(K + 1),
                                       BLOCK_V=block_v, V_BLOCKS=triton.cdiv(V, block_v), HAS_Q=K > 0,
                                       num_warps=4 if block_v <= 1024 else 8)
    return accepted, emitted
