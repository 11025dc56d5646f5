"""Paged MLA KV cache: per token the compressed latent c_kv [R] and the roped key k_pe [P].

Blocks of `block_size` tokens come from one pool shared by all requests. A request owns a block
table and a length; `extend` appends positions (all-or-nothing), `rollback` drops the last n
(rejected drafts), `release` returns every block. Exhaustion raises CacheFullError, never
overwrites another request's slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """The block pool cannot hold the requested positions."""


class UnknownRequestError(KeyError):
    """A request id the cache does not hold (never allocated, or released)."""


@dataclass
class AttentionBatch:
    """Per-step layout shared by all layers. N new tokens of B requests, flattened request-major."""
    positions: torch.Tensor       # [N] absolute position of each new token
    slot_mapping: torch.Tensor    # [N] flat cache slot the new token is written to
    context_slots: torch.Tensor   # [B, Lmax] flat slots of each request's whole context (0-padded)
    query_pad_index: torch.Tensor # [N] index into a [B * Tmax] padded query layout
    mask: torch.Tensor            # [B, Tmax, Lmax] True where the query may attend the key
    query_lens: list[int]
    request_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_token_index(self) -> torch.Tensor:
        # [B] row of each request's last new token in the flattened [N] layout
        ends = torch.tensor(self.query_lens, device=self.positions.device).cumsum(0)
        return ends - 1


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        # ckv: [layers, blocks, block_size, R]; kpe: [layers, blocks, block_size, P]
        self.ckv = torch.zeros(num_layers, num_blocks, block_size, kv_lora_rank, dtype=dtype, device=device)
        self.kpe = torch.zeros(num_layers, num_blocks, block_size, rope_dim, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._lengths

    def request_ids(self) -> list[str]:
        return list(self._lengths)

    def length(self, request_id: str) -> int:
        self._check(request_id)
        return self._lengths[request_id]

    def _check(self, request_id: str) -> None:
        if request_id not in self._lengths:
            raise UnknownRequestError(f"request {request_id!r} has no KV cache (never started or released)")

    def allocate(self, request_id: str) -> None:
        if request_id in self._lengths:
            raise ValueError(f"request {request_id!r} already has a KV cache")
        self._tables[request_id], self._lengths[request_id] = [], 0

    def blocks_needed(self, request_id: str, n: int) -> int:
        have = len(self._tables.get(request_id, []))
        return max(0, -(-(self._lengths.get(request_id, 0) + n) // self.block_size) - have)

    def extend(self, request_id: str, n: int) -> None:
        self._check(request_id)
        need = self.blocks_needed(request_id, n)
        if need > len(self._free):
            raise CacheFullError(f"KV cache pool exhausted: request {request_id!r} needs {need} more "
                                 f"blocks of {self.block_size} tokens, {len(self._free)} of "
                                 f"{self.num_blocks} free")
        self._tables[request_id].extend(self._free.pop() for _ in range(need))
        self._lengths[request_id] += n

    def rollback(self, request_id: str, n: int) -> None:
        self._check(request_id)
        if not 0 <= n <= self._lengths[request_id]:
            raise ValueError(f"cannot roll back {n} positions of request {request_id!r} "
                             f"holding {self._lengths[request_id]}")
        self._lengths[request_id] -= n
        keep = -(-self._lengths[request_id] // self.block_size)
        table = self._tables[request_id]
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, request_id: str) -> None:
        if request_id in self._lengths:
            self._free.extend(reversed(self._tables.pop(request_id)))
            del self._lengths[request_id]

    def _slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(self._tables[request_id], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # --- one step ------------------------------------------------------------------------------
    def prepare(self, request_ids: list[str], query_lens: list[int]) -> AttentionBatch:
        """Extend each request by its new-token count and lay out the step's attention batch.

        All-or-nothing: if the pool cannot hold the whole step, nothing is extended.
        """
        if len(request_ids) != len(query_lens) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be unique and match query_lens")
        for rid in request_ids:
            self._check(rid)
        need = sum(self.blocks_needed(r, n) for r, n in zip(request_ids, query_lens))
        if need > len(self._free):
            raise CacheFullError(f"KV cache pool exhausted: step needs {need} more blocks of "
                                 f"{self.block_size} tokens, {len(self._free)} of {self.num_blocks} free")
        starts = [self._lengths[r] for r in request_ids]
        for r, n in zip(request_ids, query_lens):
            self.extend(r, n)
        B, tmax = len(request_ids), max(query_lens)
        lmax = max(s + n for s, n in zip(starts, query_lens))
        positions, slots, pad_index = [], [], []
        context = torch.zeros(B, lmax, dtype=torch.long)
        for b, (r, s, n) in enumerate(zip(request_ids, starts, query_lens)):
            positions.append(torch.arange(s, s + n))
            ctx = self._slots(r, 0, s + n)
            context[b, : s + n] = ctx
            slots.append(ctx[s:])
            pad_index.append(torch.arange(n) + b * tmax)
        qpos = torch.tensor(starts)[:, None] + torch.arange(tmax)[None, :]       # [B, Tmax]
        mask = torch.arange(lmax)[None, None, :] <= qpos[:, :, None]             # causal over context
        dev = self.device
        return AttentionBatch(
            positions=torch.cat(positions).to(dev), slot_mapping=torch.cat(slots).to(dev),
            context_slots=context.to(dev), query_pad_index=torch.cat(pad_index).to(dev),
            mask=mask.to(dev), query_lens=list(query_lens), request_ids=list(request_ids))
