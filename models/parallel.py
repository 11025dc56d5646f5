"""Parallel layout of one process: its tensor-parallel and expert-parallel rank, and the groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1                 # expert groups among the TP ranks (ep divides tp)
    sequence_parallel: bool = False  # SP-MoE: rows reduce-scattered across TP ranks around each MoE
    tp_group: object = None

    def decide(self, t: torch.Tensor) -> torch.Tensor:
        """Make rank 0's decision (sampled tokens, accepted counts; a CPU tensor) every rank's."""
        if self.tp_size == 1:
            return t
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.tp_group) == "nccl" else "cpu"
        x = t.to(dev)
        dist.broadcast(x, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return x.cpu()

    def shard(self, n: int, what: str) -> int:
        if n % self.tp_size:
            raise ValueError(f"{what} ({n}) is not divisible by tp={self.tp_size}")
        return n // self.tp_size


SINGLE = ParallelState()


def all_reduce(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    # x: [R, D] on each rank -> [size * R, D], rank order
    if size == 1:
        return x
    out = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.cat(out, 0)


def all_gather_cols(x: torch.Tensor, group, size: int) -> torch.Tensor:
    # x: [N, C] on each rank -> [N, size * C]
    if size == 1:
        return x
    out = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.cat(out, -1)


def reduce_scatter_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    # x: [size * R, D] partial sums on each rank -> [R, D] full sums of this rank's rows
    if size == 1:
        return x
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.device.type == "cpu":  # gloo has no reduce_scatter: all-reduce, then keep own slice
        dist.all_reduce(x, group=group)
        return x.chunk(size, 0)[dist.get_rank(group)].clone()
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out
