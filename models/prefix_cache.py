"""The block pool of a paged cache: free blocks, reference counts, and (prefix caching on) a content index
of full blocks with an LRU of the cached blocks no request references.

A full block is named by a hash chain: key_j = blake2b(key_{j-1} | the tokens that decide block j's
values), key_{-1} = blake2b(salt). The salt holds everything else that changes the cached values (the
model's identity, dtype, block size, index scoring; for the draft also where its hidden rows come from).
`shift` says which tokens decide a block: the target's block j holds positions [j*bs, (j+1)*bs), decided by
tokens[0 : (j+1)*bs] (shift 0); the draft's position i pairs token i+1 with the target's row i, so its
block j is decided by tokens[0 : (j+1)*bs + 1] (shift 1).

Only full blocks of committed positions are ever named ("sealed"). A request writes only at positions
at or after its committed length, so a sealed block is never written again: rejected drafts roll back
positions past it, and a request that shares a block by a hit starts writing after it (no copy-on-write
is needed). Sharing is copy-free: the block id goes into the new request's block table.

Blocks: referenced (refs > 0) | cached (refs == 0, named, in the LRU, reusable by a hit) | free. Taking
a block takes a free one first, else evicts the least recently released cached block.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class PoolExhausted(RuntimeError):
    """Fewer blocks free or evictable than asked for (the cache turns it into CacheFullError)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.salt: bytes | None = None                       # None: prefix caching off
        self.shift = 0
        self._key_of: dict[int, bytes] = {}                  # named block -> key
        self._block_of: dict[bytes, int] = {}                # key -> named block
        self._lru: OrderedDict[int, None] = OrderedDict()    # cached blocks (refs 0), least recent first
        self.queries = self.hits = 0                         # tokens looked up / found (vLLM's counters)
        self.evictions = 0                                   # cached blocks taken for new content

    def enable(self, salt: str, shift: int) -> None:
        """Turn prefix caching on: full blocks named under `salt`, decided by tokens up to (j+1)*bs + shift."""
        self.salt, self.shift = hashlib.blake2b(salt.encode(), digest_size=16).digest(), shift

    @property
    def enabled(self) -> bool:
        return self.salt is not None

    @property
    def available(self) -> int:
        """Blocks a request can take now: free, or cached and unreferenced (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def take(self, n: int) -> list[int]:
        if n > self.available:
            raise PoolExhausted(n)
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:                                            # evict the least recently released cached block
                b, _ = self._lru.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def give(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a request's table, last block first)."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise AssertionError(f"block {b} released more often than taken")
            if self.refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None                      # most recent at the end
                else:
                    self._free.append(b)

    # --- naming and finding full blocks -----------------------------------------------------------
    def keys(self, tokens: list[int], n_blocks: int, prev: list[bytes]) -> list[bytes]:
        """The chain keys of blocks 0..n_blocks-1 of `tokens`, extending the already known `prev`."""
        bs, out = self.block_size, list(prev)
        for j in range(len(prev), n_blocks):
            lo = j * bs + (self.shift if j else 0)
            chunk = tokens[lo:(j + 1) * bs + self.shift]
            h = hashlib.blake2b(out[-1] if out else self.salt, digest_size=16)
            h.update(array("q", chunk).tobytes())
            out.append(h.digest())
        return out

    def lookup(self, tokens: list[int], max_positions: int, queried: int) -> tuple[list[int], list[bytes]]:
        """The longest chain of cached full blocks that starts `tokens`, at most max_positions positions,
        referenced for the caller -> (blocks, their keys). Counts `queried` tokens and the hit's positions."""
        n = max(0, min(max_positions, len(tokens) - self.shift) // self.block_size)
        blocks, keys = [], []
        if self.enabled:
            for key in self.keys(tokens, n, []):
                b = self._block_of.get(key)
                if b is None:
                    break
                blocks.append(b)
                keys.append(key)
        for b in blocks:
            if self.refs[b] == 0:
                self._lru.pop(b)
            self.refs[b] += 1
        self.queries += queried
        self.hits += len(blocks) * self.block_size
        return blocks, keys

    def seal(self, table: list[int], tokens: list[int], committed: int, known: list[bytes]) -> list[bytes]:
        """Name the full blocks of `table` below `committed` positions (their tokens in `tokens`); `known`:
        keys already named for this table. A block whose content is already cached under another id stays
        unnamed (it is freed on release). -> the table's keys now."""
        if not self.enabled:
            return known
        n = min(committed, len(tokens) - self.shift) // self.block_size
        if n <= len(known):
            return known
        keys = self.keys(tokens, n, known)
        for j in range(len(known), n):
            b, key = table[j], keys[j]
            if key not in self._block_of and b not in self._key_of:
                self._block_of[key], self._key_of[b] = b, key
        return keys

    def check_idle(self) -> None:
        """With no request holding blocks: every reference is gone and every block is free or cached."""
        held = [b for b, r in enumerate(self.refs) if r]
        if held or len(self._free) + len(self._lru) != self.num_blocks:
            raise AssertionError(f"blocks still referenced {held[:8]}, free {len(self._free)} + cached "
                                 f"{len(self._lru)} of {self.num_blocks}")
