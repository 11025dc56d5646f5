"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with `launch(x)`'s options may start while the kernel before it on the stream is finishing; its
programs first wait (`wait_prior`) for that kernel's completion and memory, then run as before. What it saves is
the gap between two dependent launches inside a CUDA graph: ~0.5 us a kernel on an H200 (BENCHMARKS.md, twenty-first
session). The rule that keeps stream order intact: such a kernel calls wait_prior(PDL) first in every program,
before any load, store or return; then its completion still implies that of every kernel before it. Off on CPU
(the interpreter), before Hopper, and with TANDEM_PDL=0 (read at each launch).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

ENV = "TANDEM_PDL"


@triton.jit
def wait_prior(PDL: tl.constexpr):
    # the first statement of a kernel that `launch` may launch early
    if PDL:
        gdc_wait()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get(ENV, "1").strip() != "0" and _capable(x.device.index or 0)


def launch(x: torch.Tensor) -> dict:
    """The kernel's PDL flag and launch options for a kernel on x's device: kernel[grid](..., **launch(x))."""
    return {"PDL": True, "launch_pdl": True} if enabled(x) else {"PDL": False}
