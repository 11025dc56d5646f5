"""Row movement around the model, as small pure functions (PyTorch reference of kernels/triton_rows.py).

SP pad / shard / trim: with sequence-parallel MoE, N rows are padded to a multiple of tp, each rank
keeps its S = N_pad / tp rows (reduce-scatter), and after the MoE the all-gathered [tp * S, D] is
trimmed back to the true N rows. models/model.py pads, shards and trims through kernels.dispatch.
"""
from __future__ import annotations

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
