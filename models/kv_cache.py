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

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from infra.errors import KV_CACHE_FULL
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


@dataclass
class AttentionBatch:
    """Per-step layout shared by all layers. N new tokens of B requests, flattened request-major.

    The device tensors below are what the kernels read (fixed shapes given N, B and the table width,
    so a CUDA graph can hold them as static buffers); the reference fields (`context_slots`,
    `query_pad_index`, `mask`) are built from the host copy on first use, for the PyTorch path only.
    """
    positions: torch.Tensor       # [N] int64 absolute position of each new token
    slot_mapping: torch.Tensor    # [N] int64 flat cache slot the new token is written to
    token_request: torch.Tensor   # [N] int32 request index b of each new token
    context_lens: torch.Tensor    # [B] int32 keys request b attends after this step (start + query len)
    query_start: torch.Tensor     # [B + 1] int32 first row of each request's tokens (qo_indptr)
    block_tables: torch.Tensor    # [B, max_blocks] int32 page ids of each request, 0-padded
    query_lens: list[int]
    request_ids: list[str]
    block_size: int = 16
    host_block_tables: torch.Tensor | None = None   # CPU copy of block_tables (planning, reference)
    host_starts: list[int] | None = None            # context length of each request before this step
    attention_backend: str | None = None            # force 'triton' / 'reference' / ... (graphs: 'triton')
    plans: dict = field(default_factory=dict, repr=False)   # per-step backend state (e.g. a FlashInfer plan)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_token_index(self) -> torch.Tensor:
        # [B] row of each request's last new token in the flattened [N] layout
        ends = torch.tensor(self.query_lens, device=self.positions.device).cumsum(0)
        return ends - 1

    # --- reference layout (kernels/mla.py): padded [B, Lmax] context, dense mask ----------
    @property
    def context_slots(self) -> torch.Tensor:    # [B, Lmax] flat slots of each request's context (0-padded)
        return self._reference()[0]

    @property
    def query_pad_index(self) -> torch.Tensor:  # [N] index into a [B * Tmax] padded query layout
        return self._reference()[1]

    @property
    def mask(self) -> torch.Tensor:             # [B, Tmax, Lmax] True where the query may attend the key
        return self._reference()[2]

    def _reference(self):
        if "reference" not in self.plans:
            starts, lens, bs = self.host_starts, self.query_lens, self.block_size
            B, tmax = len(lens), max(lens, default=0)
            ctx = [s + n for s, n in zip(starts, lens)]
            lmax = max(ctx, default=0)
            j = torch.arange(lmax)
            slots = self.host_block_tables.long().gather(1, (j // bs)[None].expand(B, -1).clamp(
                max=self.host_block_tables.shape[1] - 1)) * bs + j % bs                # [B, Lmax]
            slots = slots.masked_fill(j[None, :] >= torch.tensor(ctx)[:, None], 0)
            pad = torch.cat([torch.arange(n) + b * tmax for b, n in enumerate(lens)]) if B else torch.zeros(0).long()
            qpos = torch.tensor(starts)[:, None] + torch.arange(tmax)[None, :]         # [B, Tmax]
            mask = j[None, None, :] <= qpos[:, :, None]                                 # causal over context
            dev = self.positions.device
            self.plans["reference"] = (slots.to(dev), pad.to(dev), mask.to(dev))
        return self.plans["reference"]


def aligned_parts(parts: list[list[int]], multiple: int = 4) -> tuple[torch.Tensor, list[int]]:
    """Host int lists laid end to end in one int64 tensor, each from a multiple of `multiple` elements (4: 16 bytes
    as int32 or int64), zeros between -> (flat, start of each). Triton compiles a kernel once per alignment of its
    pointers: views at offsets of N elements would make an eager step of another N mod 4 compile a variant mid-run
    (about a second). Built as an array, not by torch.tensor(list) (3-4x slower per element)."""
    flat, starts = array("q"), []
    for p in parts:
        starts.append(len(flat))
        flat.extend(p)
        flat.extend([0] * (-len(flat) % multiple))
    return torch.frombuffer(flat, dtype=torch.long), starts


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
    def prepare(self, request_ids: list[str], query_lens: list[int]) -> AttentionBatch:
        """Extend each request by its new-token count and lay out the step's attention batch.

        All-or-nothing: if the pool cannot hold the whole step, nothing is extended.
        """
        if len(request_ids) != len(query_lens) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be unique and match query_lens")
        for rid in request_ids:
            self._check(rid)
        need = sum(self.blocks_needed(r, n) for r, n in zip(request_ids, query_lens))
        if need > self.pool.available:
            raise CacheFullError(f"{KV_CACHE_FULL}: step needs {need} more blocks of "
                                 f"{self.block_size} tokens, {self.pool.available} of {self.num_blocks} free")
        starts = [self._lengths[r] for r in request_ids]
        for r, n in zip(request_ids, query_lens):
            self.extend(r, n)
        return self._layout(request_ids, query_lens, starts)

    def _layout(self, request_ids: list[str], query_lens: list[int], starts: list[int]) -> AttentionBatch:
        # built on the host in one array, moved in one transfer: [positions N | slots N | token_request N |
        # context_lens B | query_start B+1 | block_tables B*MB], the int32 part cast once on the device; each part
        # starts 16-byte aligned (aligned_parts). Python lists, not ~25 small CPU tensor ops: a decode step's layout
        # is on its critical path (BENCHMARKS.md, twenty-second session, item 6)
        bs, B, N = self.block_size, len(request_ids), sum(query_lens)
        tables = [self._tables[r] for r in request_ids]
        mb = max([len(t) for t in tables] + [1])
        pos, slots, req, qstart = [], [], [], [0]
        for b, (t, s, n) in enumerate(zip(tables, starts, query_lens)):
            pos += range(s, s + n)
            for j in range(s // bs, -(-(s + n) // bs)):                           # slots: runs within a block
                slots += range(t[j] * bs + max(s - j * bs, 0), t[j] * bs + min(s + n - j * bs, bs))
            req += [b] * n
            qstart.append(qstart[-1] + n)
        flat_tables = [x for t in tables for x in t + [0] * (mb - len(t))]
        host, at = aligned_parts([pos, slots, req, [s + n for s, n in zip(starts, query_lens)], qstart, flat_tables])
        packed = host.to(self.device)
        small = packed[at[2]:].to(torch.int32)
        i32 = [a - at[2] for a in at[2:]]
        return AttentionBatch(
            positions=packed[at[0]:at[0] + N], slot_mapping=packed[at[1]:at[1] + N], token_request=small[:N],
            context_lens=small[i32[1]:i32[1] + B], query_start=small[i32[2]:i32[2] + B + 1],
            block_tables=small[i32[3]:i32[3] + B * mb].view(B, mb), query_lens=list(query_lens),
            request_ids=list(request_ids), block_size=bs,
            host_block_tables=host[at[5]:at[5] + B * mb].view(B, mb).to(torch.int32), host_starts=starts)
