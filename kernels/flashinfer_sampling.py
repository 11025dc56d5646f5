"""FlashInfer's fused chain speculative sampling as an alternative verifier (TANDEM_VERIFIER=flashinfer).

Same contract as kernels.speculative.rejection_sample (accepted [B], emitted [B, K+1] padded with -1),
same acceptance rule (accept d_i with probability min(1, p/q), residual at the first rejection, bonus
from p_K). It draws its own randomness from one device generator, so it serves requests without a
seed only (a seeded request must replay its own stream: the Tandem kernels do that), and batches where
every request drafted the same K (FlashInfer has no per-request draft count).
"""
from __future__ import annotations

import os

import torch

ENV = "TANDEM_VERIFIER"
_fi = None


def _flashinfer():
    global _fi
    if _fi is None:
        try:
            import flashinfer.sampling as fs
            _fi = fs
        except Exception:  # ImportError, or a broken install: the Tandem kernels serve instead
            _fi = False
    return _fi


def requested() -> bool:
    """TANDEM_VERIFIER=flashinfer (default: tandem)."""
    v = os.environ.get(ENV, "tandem").strip().lower() or "tandem"
    if v not in ("tandem", "flashinfer"):
        raise ValueError(f"{ENV}={v!r}: expected tandem or flashinfer")
    return v == "flashinfer"


def applies(p: torch.Tensor, num_drafts: torch.Tensor, seeded: bool) -> bool:
    """Whether chain_speculative_sampling can verify this batch: asked for, importable, on CUDA,
    unseeded, one draft count for all. (num_drafts is on the host: no device read-back.)"""
    K = p.shape[1] - 1
    return (requested() and p.is_cuda and not seeded and K > 0 and bool(_flashinfer())
            and bool((num_drafts == K).all()))


def chain_verify(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor,
                 generator: torch.Generator | None = None):
    """p [B, K+1, V], q [B, K, V], draft_ids [B, K] (all K drafted) -> accepted [B], emitted [B, K+1]."""
    B, K = draft_ids.shape
    fs = _flashinfer()
    accepted = torch.zeros(B, dtype=torch.int32, device=p.device)
    emitted_drafts = torch.zeros(B, dtype=torch.int32, device=p.device)
    res = fs.chain_speculative_sampling(q.float().contiguous(), draft_ids.to(torch.int32).contiguous(),
                                        p.float().contiguous(), accepted, emitted_drafts,
                                        deterministic=True, generator=generator)
    # (token ids, accepted-if-independent, emitted drafts); token ids [B, K+1]: the emitted drafts,
    # then the residual / bonus token, then -1
    out, emitted = (res[0], res[2]) if isinstance(res, tuple) else (res, emitted_drafts)
    return emitted.long(), out.long()
