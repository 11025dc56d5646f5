"""Row movement around the model, as small pure functions (PyTorch reference of kernels/triton_rows.py).

SP pad / shard / trim: with sequence-parallel MoE, N rows are padded to a multiple of tp, each rank
keeps its S = N_pad / tp rows (reduce-scatter), and after the MoE the all-gathered [tp * S, D] is
trimmed back to the true N rows. models/model.py pads, shards and trims through kernels.dispatch.

CPU GEMM rows: PyTorch's CPU fp32 GEMM (one thread, as the services run) gives a row the same bits at any row count
of 4 or more, other bits at 1 to 3 (BENCHMARKS.md "Lossless on the CPU"), so a decode step's rows would part from a
verify step's at a near-tie; gemm_ready pads a CPU GEMM's left operand to 4 rows (rows never mix in a GEMM; the
class is probed once a process per thread count, cpu_gemm_rows, as another CPU's BLAS may start it elsewhere).
Its vectorized elementwise functions (sigmoid) give an element other bits in a loop's scalar tail than in its
vector body, so a [1, 8] tensor's row is not the same row of a [4, 8] one; vector_ready pads a CPU tensor's rows
until its elements fill whole vectors (no tail).
"""
from __future__ import annotations

import logging
import math
import os

import torch


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    # x: [N, D] -> [ceil(N / multiple) * multiple, D], zero rows appended (the reduce-scatter input)
    extra = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) if extra else x


def shard_rows(x_pad: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    # x_pad: [tp * S, D] identical on all ranks -> rank's [S, D] (rows rank * S .. rank * S + S - 1)
    return x_pad.chunk(tp, 0)[rank] if tp > 1 else x_pad


def pad_shard_rows(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    # x: [N, D] -> rank's [ceil(N / tp), D] of pad_rows(x, tp): what SP keeps before its reduce-scatter
    return shard_rows(pad_rows(x, tp), tp, rank)


def trim_rows(gathered: torch.Tensor, n: int) -> torch.Tensor:
    # gathered: [tp * S, D] all-gathered shards in rank order -> the true [n, D] (n <= tp * S)
    assert n <= gathered.shape[0], f"trim to {n} rows of {gathered.shape[0]}"
    return gathered[:n]


def take_spans(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    # x: [N, D], spans: [(start, end)] in order -> the spans' rows [sum(end - start), D], always a copy (x may be a
    # CUDA graph's output buffer, which the next step rewrites): back-to-back spans are one slice, others a gather
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return x[spans[0][0]:spans[-1][1]].clone() if spans else x[:0].clone()
    return x[torch.cat([torch.arange(s, e) for s, e in spans]).to(x.device)]


_cpu_rows: dict[int, int] = {}      # torch CPU threads -> rows (a process may change its thread count)


def cpu_gemm_rows() -> int:
    """Rows a CPU GEMM runs as at least: TANDEM_CPU_GEMM_ROWS (1: off, to measure what it costs), else probed once in
    this process per thread count: the smallest of 4, 8, 16, 32 from which its fp32 GEMM gives a row the same bits
    at any row count and position (4 on this project's CPU on one thread, 16 on two); 1 where none does."""
    threads = torch.get_num_threads()
    rows = _cpu_rows.get(threads)
    if rows is None:
        env = os.environ.get("TANDEM_CPU_GEMM_ROWS", "")
        rows = _cpu_rows[threads] = int(env) if env else _probe_rows()
        if rows == 1 and not env:
            logging.getLogger("tandem").warning("this CPU's GEMM gives a row other bits at other row counts from 4 to "
                                                "32 (%d threads): a verify row may part from its decode row at a "
                                                "near-tie (kernels/rows.py)", threads)
    return rows


def _probe_rows() -> int:
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(80, k, generator=g), torch.randn(n, k, generator=g)) for n, k in ((96, 256), (64, 1024))]
    full = [x[:72] @ w.t() for x, w in cases]
    for r in (4, 8, 16, 32):
        if all(torch.equal(x[s:s + m] @ w.t(), f[s:s + m]) for (x, w), f in zip(cases, full)
               for s in (0, 3) for m in range(r, 2 * r + 5)):
            return r
    return 1


def gemm_ready(x: torch.Tensor) -> torch.Tensor:
    # x: [M, ...], the left operand of a GEMM over its rows -> at least cpu_gemm_rows() rows on a CPU (zero rows
    # appended), else x
    m = x.shape[0]
    if x.is_cuda or m == 0:
        return x
    least = cpu_gemm_rows()
    return x if m >= least else torch.cat([x, x.new_zeros(least - m, *x.shape[1:])])


CPU_VECTOR = 64                     # elements: a multiple of every CPU vector loop's step (AVX-512 x 4 floats)


def vector_ready(x: torch.Tensor) -> torch.Tensor:
    # x: [M, ...] contiguous -> on a CPU [M', ...], zero rows appended until M' x row size is a multiple of 64
    row = x[0].numel() if x.shape[0] else 0
    extra = -x.shape[0] % (CPU_VECTOR // math.gcd(row, CPU_VECTOR)) if row and not x.is_cuda else 0
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) if extra else x
