"""Paged MLA KV cache: per token the compressed latent c_kv [R] and the roped key k_pe [P]; for a
DeepSeek-V3.2 model also its indexer key [D_idx] (and, in deployed scoring, that key's fp8 scale), in
the same blocks: one block table, one rollback and one release serve all of them.

Blocks of `block_size` tokens come from one pool shared by all requests. A request owns a block
table and a length; `extend` appends positions (all-or-nothing), `rollback` drops the last n
(rejected drafts), `release` returns every block. Exhaustion raises CacheFullError, never
overwrites another request's slots. With prefix caching on (`enable_prefix_cache`), full committed
blocks are named by content and shared between requests (models/prefix_cache.py): `allocate` may
start a request on cached blocks found by `lookup`, `seal` names its full blocks as they commit.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from infra.errors import KV_CACHE_FULL
from models.batch import AttentionBatch, lay_out  # AttentionBatch re-exported: the layers import it from here
from models.prefix_cache import BlockPool, PoolExhausted

INDEX_SCORINGS = ("exact", "deployed")      # kernels/dsa.py: fp32 scores / Hadamard + fp8 keys


def index_scoring_for(choice: str, device) -> str:
    """'auto' -> deployed on CUDA (DeepSeek's fp8 scoring), exact elsewhere; an explicit choice stays."""
    if choice == "auto":
        return "deployed" if torch.device(device).type == "cuda" else "exact"
    if choice not in INDEX_SCORINGS:
        raise ValueError(f"index scoring must be auto or one of {INDEX_SCORINGS}, got {choice!r}")
    return choice


class LayerKV(NamedTuple):
    """One layer's cache tensors (views): ckv [blocks, bs, R], kpe [blocks, bs, P]; V3.2 only: index_k
    [blocks, bs, D_idx] (model dtype, or fp8 e4m3 in deployed scoring), index_scale [blocks, bs] fp32
    (deployed scoring) or None."""
    ckv: torch.Tensor
    kpe: torch.Tensor
    index_k: torch.Tensor | None = None
    index_scale: torch.Tensor | None = None
    arrivals: torch.Tensor | None = None    # int32, zero between launches: the split attention's counters


class PrefixHit(NamedTuple):
    """Cached full blocks found for a new request's tokens (referenced for it), their keys, their positions."""
    blocks: list[int]
    keys: list[bytes]
    positions: int


class CacheFullError(RuntimeError):
    """The block pool cannot hold the requested positions."""


class UnknownRequestError(KeyError):
    """A request id the cache does not hold (never allocated, or released)."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 index_head_dim: int = 0, index_scoring: str = "exact"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if index_scoring not in INDEX_SCORINGS:
            raise ValueError(f"index_scoring must be one of {INDEX_SCORINGS}, got {index_scoring!r}")
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        # ckv: [layers, blocks, block_size, R]; kpe: [layers, blocks, block_size, P]
        self.ckv = torch.zeros(num_layers, num_blocks, block_size, kv_lora_rank, dtype=dtype, device=device)
        self.kpe = torch.zeros(num_layers, num_blocks, block_size, rope_dim, dtype=dtype, device=device)
        # V3.2: index_k [layers, blocks, block_size, D_idx]; deployed: fp8 keys + index_scale [layers, blocks, bs]
        self.index_scoring = index_scoring if index_head_dim else None
        deployed = self.index_scoring == "deployed"
        self.index_k = torch.zeros(num_layers, num_blocks, block_size, index_head_dim, device=device,
                                   dtype=torch.float8_e4m3fn if deployed else dtype) if index_head_dim else None
        self.index_scale = (torch.zeros(num_layers, num_blocks, block_size, dtype=torch.float32, device=device)
                            if deployed else None)
        self.arrivals = torch.zeros(1 << 15, dtype=torch.int32, device=device)   # kernels/triton_mla.py's counters
        self.pool = BlockPool(num_blocks, block_size)
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        self._keys: dict[str, list[bytes]] = {}              # prefix caching: keys of each table's named blocks
        self._sealed: dict[str, int] = {}                    # positions a request may not roll back past
        self.staging = None     # (B, N, table width) -> a graph bucket's Stage or None (models/cuda_graphs.py)

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.ckv[i], self.kpe[i], None if self.index_k is None else self.index_k[i],
                       None if self.index_scale is None else self.index_scale[i], self.arrivals)

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take: free, or cached by prefix caching and referenced by no request."""
        return self.pool.available

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.available

    def enable_prefix_cache(self, salt: str, shift: int = 0) -> None:
        """Prefix caching on (models/prefix_cache.py): salt names what else decides the cached values."""
        self.pool.enable(f"{salt}|bs={self.block_size}|index={self.index_scoring}", shift)

    def lookup(self, tokens: list[int], max_positions: int) -> PrefixHit:
        """Cached full blocks that start `tokens` (at most max_positions positions), referenced for the
        request `allocate` is given them next (or give them back with `drop`). Counts a query of
        len(tokens) - shift tokens and a hit of the positions found."""
        blocks, keys = self.pool.lookup(tokens, max_positions, len(tokens) - self.pool.shift)
        return PrefixHit(blocks, keys, len(blocks) * self.block_size)

    def drop(self, hit: PrefixHit | None) -> None:
        """Give back the references of a hit that no request took."""
        if hit is not None:
            self.pool.give(hit.blocks)

    def seal(self, request_id: str, tokens: list[int], committed: int) -> None:
        """Name the request's full blocks below `committed` positions (`tokens`: its tokens so far)."""
        self._check(request_id)
        self._keys[request_id] = self.pool.seal(self._tables[request_id], tokens, committed,
                                                self._keys[request_id])
        self._sealed[request_id] = len(self._keys[request_id]) * self.block_size

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

    def allocate(self, request_id: str, hit: PrefixHit | None = None) -> None:
        """A new request with no positions, or starting on the cached blocks of `hit` (from `lookup`)."""
        if request_id in self._lengths:
            self.drop(hit)
            raise ValueError(f"request {request_id!r} already has a KV cache")
        self._tables[request_id] = list(hit.blocks) if hit else []
        self._keys[request_id] = list(hit.keys) if hit else []
        self._lengths[request_id] = self._sealed[request_id] = hit.positions if hit else 0

    def blocks_needed(self, request_id: str, n: int) -> int:
        have = len(self._tables.get(request_id, []))
        return max(0, -(-(self._lengths.get(request_id, 0) + n) // self.block_size) - have)

    def extend(self, request_id: str, n: int) -> None:
        self._check(request_id)
        need = self.blocks_needed(request_id, n)
        try:
            self._tables[request_id].extend(self.pool.take(need))
        except PoolExhausted:
            raise CacheFullError(f"{KV_CACHE_FULL}: request {request_id!r} needs {need} more "
                                 f"blocks of {self.block_size} tokens, {self.pool.available} of "
                                 f"{self.num_blocks} free") from None
        self._lengths[request_id] += n

    def rollback(self, request_id: str, n: int) -> None:
        self._check(request_id)
        if not 0 <= n <= self._lengths[request_id] - self._sealed[request_id]:
            raise ValueError(f"cannot roll back {n} positions of request {request_id!r} holding "
                             f"{self._lengths[request_id]} ({self._sealed[request_id]} sealed)")
        self._lengths[request_id] -= n
        keep = -(-self._lengths[request_id] // self.block_size)
        table = self._tables[request_id]
        if len(table) > keep:
            self.pool.give(table[keep:])
            del table[keep:]

    def release(self, request_id: str) -> None:
        if request_id in self._lengths:
            self.pool.give(self._tables.pop(request_id))
            for d in (self._lengths, self._keys, self._sealed):
                del d[request_id]

    # --- one step ------------------------------------------------------------------------------
    def prepare(self, request_ids: list[str], query_lens: list[int],
                tokens: list[int] | None = None) -> AttentionBatch:
        """Extend each request by its new-token count and lay out the step's attention batch (with `tokens`, the
        step's input ids, flattened request-major, in the same transfer: batch.input_ids). Where `staging` gives a
        CUDA graph bucket's buffers for the step's shape, the batch is laid out into them (models/batch.py).

        All-or-nothing: if the pool cannot hold the whole step, nothing is extended.
        """
        if len(request_ids) != len(query_lens) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be unique and match query_lens")
        if tokens is not None and len(tokens) != sum(query_lens):
            raise ValueError(f"tokens: expected {sum(query_lens)} (the step's new tokens), got {len(tokens)}")
        lengths, tables, bs = self._lengths, self._tables, self.block_size
        for rid in request_ids:
            if rid not in lengths:
                self._check(rid)
        starts = [lengths[r] for r in request_ids]
        needs = [max(0, -(-(s + n) // bs) - len(tables[r])) for r, s, n in zip(request_ids, starts, query_lens)]
        need = sum(needs)
        if need > self.pool.available:
            raise CacheFullError(f"{KV_CACHE_FULL}: step needs {need} more blocks of "
                                 f"{self.block_size} tokens, {self.pool.available} of {self.num_blocks} free")
        taken, at = self.pool.take(need) if need else [], 0           # in one take: the blocks extend() would get
        for r, s, n, k in zip(request_ids, starts, query_lens, needs):
            if k:
                tables[r].extend(taken[at:at + k])
                at += k
            lengths[r] = s + n
        return self._layout(request_ids, query_lens, starts, tokens)

    def _layout(self, request_ids: list[str], query_lens: list[int], starts: list[int],
                tokens: list[int] | None) -> AttentionBatch:
        tables = [self._tables[r] for r in request_ids]
        width = max([len(t) for t in tables] + [1])
        stage = self.staging(len(tables), sum(query_lens), width) if self.staging else None
        return lay_out(request_ids, tables, starts, query_lens, self.block_size, self.device, tokens, stage)
