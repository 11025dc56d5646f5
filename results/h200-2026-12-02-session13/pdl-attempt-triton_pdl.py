"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a decode step (issue 14).

In a CUDA graph a kernel still starts only after the kernel before it has ended, about a microsecond a launch on
an H200, paid ~20 times a layer at batch 1. Launched with PDL, a kernel's programs are placed as soon as every
program of the kernel before it has begun (each signals with gdc_launch_dependents once it runs), and they wait in
gdc_wait until that kernel has finished and its writes are visible: the same order, with the gap overlapped.

A kernel launched with `**launch(x)` must begin with `prior(PDL)`, before any load or store: then it touches
nothing until the kernel before it is done, and by induction every kernel before that. Kernels launched without
PDL (cuBLAS, torch's) wait as always, and a kernel after them starts when they end.
TANDEM_PDL=auto (default: on CUDA devices of compute capability 9 or more) | off, read at each launch.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "TANDEM_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in ("auto", "off"):
        raise ValueError(f"{ENV}={m!r}: expected auto or off")
    return m == "auto" and x.is_cuda and _capable(x.device.index if x.device.index is not None
                                                  else torch.cuda.current_device())


def launch(x: torch.Tensor) -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr and Triton's launch_pdl option, on or off together."""
    on = enabled(x)
    return {"PDL": on, "launch_pdl": on} if on else {}


@triton.jit
def prior(PDL: tl.constexpr):
    # a PDL kernel's first statement: wait for the kernel before to finish, then let the next one be placed
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
