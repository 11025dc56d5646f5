"""Tiles of the fused MoE kernels (kernels/triton_moe.py bf16, kernels/triton_fp8_moe.py fp8), from shapes alone:
a captured batch size keeps its tiles, and a token's row does not depend on the other tokens of its call within
a token class.

Tiles: (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) of the gate/up kernel and of the down kernel. SPLIT_K splits the
down kernel's K (I) over that many programs, summed in a fixed order (gate/up keeps 1: silu needs whole sums).
fp8 tiles keep BLOCK_K = 128 (the scale block); a gate/up BLOCK_N of 128 quantizes h in its epilogue, a smaller
one adds a small quantization kernel.

Decode path, up to CLASSES[-1] tokens: 16-row blocks and the tiles of the token's class (1-8, 9-16, 17-32 tokens),
measured per expert shape (D, I). Batch path beyond: 16- or 64-row blocks by pair count and `batch_tiles`. A row's
bits depend on the block rows (16 and 32: mma.sync, 64: Hopper's wgmma, in fp8) and the down kernel's split, not on
the column tiles, warps or stages (measured on the H200, BENCHMARKS.md "Lossless at any batch"); every class and
the batch path's 16-row blocks keep the split at 1, so a decode row equals a verify row at any batch until 64-row
blocks start (more than 64 pairs an expert on average: prefill). `shared_inside`: whether a call reads the shared
experts in place (only with 16-row blocks).
"""
from __future__ import annotations

import os

Tiles = tuple[int, int, int, int, int]

SHARED_ENV = "TANDEM_SHARED_IN_MOE"     # 0: the shared experts by their own GEMMs (to measure what that saves)

CLASSES = (8, 16, 32)              # last token count of each decode class

# kind -> (D, I) of the experts (None: any other shape) -> class -> (gate/up tiles, down tiles).
# The winners of an H200 sweep (2026-12-01, BENCHMARKS.md "Fused MoE at decode sizes"; CUDA-graph replays, expert
# weights rotated past L2); None: the tiles with the least summed time relative to each swept shape's best.
DECODE: dict[str, dict[tuple[int, int] | None, dict[int, tuple[Tiles, Tiles]]]] = {
    "bf16": {
        None: {8: ((32, 128, 4, 5, 1), (64, 128, 4, 4, 1)),
               16: ((32, 128, 4, 5, 1), (32, 128, 4, 5, 1)),
               32: ((32, 128, 4, 4, 1), (32, 128, 2, 5, 1))},
        (2048, 1408): {8: ((32, 128, 4, 5, 1), (64, 128, 4, 4, 1)),
                       16: ((32, 128, 4, 5, 1), (64, 128, 4, 4, 1)),
                       32: ((32, 128, 4, 4, 1), (32, 128, 2, 5, 1))},
        (7168, 2048): {8: ((32, 256, 4, 3, 1), (32, 256, 4, 3, 1)),
                       16: ((32, 128, 4, 5, 1), (32, 256, 4, 3, 1)),
                       32: ((64, 128, 4, 4, 1), (64, 128, 4, 4, 1))},
    },
    "fp8": {
        None: {8: ((128, 128, 8, 4, 1), (64, 128, 4, 4, 1)),   # down unsplit, as every class (a row's bits)
               16: ((32, 128, 2, 5, 1), (32, 128, 2, 5, 1)),
               32: ((128, 128, 8, 4, 1), (64, 128, 4, 4, 1))},
        (2048, 1408): {8: ((32, 128, 4, 4, 1), (64, 128, 4, 3, 1)),
                       16: ((32, 128, 2, 5, 1), (32, 128, 2, 5, 1)),
                       32: ((128, 128, 8, 4, 1), (64, 128, 4, 3, 1))},
        (7168, 2048): {8: ((32, 128, 4, 6, 1), (64, 128, 4, 6, 1)),
                       16: ((32, 128, 4, 6, 1), (32, 128, 2, 5, 1)),
                       32: ((32, 128, 4, 6, 1), (64, 128, 4, 6, 1))},
    },
}


def token_class(tokens: int) -> int | None:
    """The decode class of a call of `tokens` tokens (its last token count), None: the batch path."""
    return next((c for c in CLASSES if tokens <= c), None)


def block_m(tokens: int, pairs: int, num_local: int) -> int:
    """Rows of a grouped block: 16 on the decode path; beyond, 16 while experts see few rows each, else 64."""
    return 16 if token_class(tokens) is not None or pairs <= 64 * num_local else 64


def decode_tiles(kind: str, tokens: int, D: int, I: int) -> tuple[Tiles, Tiles] | None:
    cls = token_class(tokens)
    if cls is None:
        return None
    table = DECODE[kind]
    return (table.get((D, I)) or table[None])[cls]


def batch_tiles(kind: str, pairs: int) -> tuple[Tiles, Tiles]:
    """Batch path, by pair count. bf16: measured on an H200 at DeepSeek-V2-Lite's shapes (2026-12-01 sweep,
    BENCHMARKS.md): few pairs want narrow column tiles, many wider ones."""
    if kind == "fp8":
        return (128, 128, 4, 3, 1), (64, 128, 4, 3, 1)
    if pairs < 512:
        return (32, 128, 4, 3, 1), (64, 128, 4, 3, 1)
    return (64, 128, 4, 3, 1), (128, 128, 4, 3, 1)


def moe_tiles(kind: str, tokens: int, pairs: int, D: int, I: int, rows: int = 16) -> tuple[Tiles, Tiles]:
    """(gate/up tiles, down tiles) of a call of `tokens` tokens routed to `pairs` (token, expert) pairs, in blocks
    of `rows` rows: the decode tiles are measured for 16-row blocks only (some do not compile for 64 rows)."""
    return (rows == 16 and decode_tiles(kind, tokens, D, I)) or batch_tiles(kind, pairs)


def shared_inside(tokens: int, top_k: int, chunks: int, num_local: int) -> bool:
    """Whether the fused MoE of a call of `tokens` tokens reads the shared experts in place, as `chunks` more experts
    every token takes (kernels/triton_moe.py): where its pairs go in 16-row blocks (decode and verify sizes; at
    prefill sizes cuBLAS runs their large GEMMs better, and those rows differ from decode rows in any case), unless
    TANDEM_SHARED_IN_MOE=0 (read at each call)."""
    return (chunks > 0 and os.environ.get(SHARED_ENV, "1").strip() != "0"
            and block_m(tokens, tokens * (top_k + chunks), num_local + chunks) == 16)
