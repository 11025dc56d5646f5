"""The tile product every Tandem Triton kernel with a tl.dot shares, and its precision per input dtype.

fp32 inputs stay fp32 ("ieee", never tf32); half types use the tensor cores ("tf32" names the
default path for them); the interpreter ("upcast") multiplies exact fp32 copies, since its bf16 / fp16
tl.dot is wrong (Triton 3.6). Kernels take the precision as a constexpr PRECISION.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    # a [M, K] @ b [K, N] -> [M, N] fp32
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(x: torch.Tensor) -> str:
    """PRECISION for kernels whose dot inputs have x's dtype and device."""
    return "ieee" if x.dtype == torch.float32 else "tf32" if x.is_cuda else "upcast"
