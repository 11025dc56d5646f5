"""How the block-scaled fp8 GEMM (kernels/triton_fp8.py) runs each call: tile, K split, warps and stages per weight
shape (N, K) and row class, measured on an H200 by `.gpu/fp8_sweep.sh` (tandem/bench_fp8_sweep.py writes TABLE);
shapes not in TABLE get `default`, the per-class rule below.

Row classes (lossless speculative decoding): a call with M rows runs the config of its class, the smallest bound
in CLASSES >= M (LARGE above the last), and within a class nothing depends on M (the split comes from (N, K) and
the class, never from M). So a row's output bits do not depend on how many rows share the call within a class:
decode (1 row) and verify (K + 1 rows) agree for K <= 7 at batch 1 (class 1..8). CUBLAS classes (torch._scaled_mm)
carry no such promise; they start above 16 rows. Imports no torch (the tables are plain data).
"""
from __future__ import annotations

from typing import NamedTuple


class Tile(NamedTuple):
    block_m: int                # rows (tokens) per program; >= 16 (a dot's smallest side)
    block_n: int                # output features per program
    kstep: int                  # 128-wide K tiles loaded per pipeline stage (wider reads of each weight row)
    fused: bool                 # activations quantized inside the GEMM (one launch) or by _quant_kernel first
    swap: bool                  # out^T = w @ x_q^T (weight rows on the MMA's long side) or out = x_q @ w^T
    warps: int
    stages: int                 # software-pipelining depth of the K loop


class Config(NamedTuple):
    tile: Tile
    split: int                  # K splits; partials summed in split order by a second kernel (1: none)


CUBLAS = None                   # a TABLE entry: torch._scaled_mm (cuBLAS, DeepSeek's scales) for this class
CLASSES = (8, 16, 32, 64, 128)  # row-class bounds
LARGE = 1 << 30                 # the class above the last bound (prefill)
SMS = 132                       # an H200's SMs: the default split's unit when the device is not asked
BLOCK_K = 128                   # the scale block: K tiles and splits are counted in it

# the tiles the sweep measures (each compiled once per output dtype); TABLE and DEFAULTS choose among them.
# 16 x 32 tiles: many programs without a K split for small weights (one launch when fused)
TILES = (
    Tile(16, 128, 1, False, True, 4, 4), Tile(16, 128, 1, False, True, 4, 6), Tile(16, 64, 1, False, True, 4, 6),
    Tile(16, 128, 2, False, True, 4, 3), Tile(16, 64, 4, False, True, 4, 3), Tile(16, 128, 1, True, False, 4, 4),
    Tile(16, 64, 2, True, False, 4, 4), Tile(16, 128, 1, True, True, 4, 4), Tile(16, 32, 2, True, False, 4, 4),
    Tile(16, 32, 1, False, False, 4, 6),
    Tile(32, 128, 1, False, True, 4, 4), Tile(32, 128, 2, False, True, 4, 3), Tile(32, 128, 1, True, False, 4, 4),
    Tile(64, 128, 1, False, True, 4, 4), Tile(64, 128, 2, False, True, 4, 3), Tile(64, 128, 1, False, False, 4, 4),
    Tile(128, 128, 1, False, True, 8, 3), Tile(128, 128, 1, False, False, 8, 3),
)

# --- measured: the block below is written by tandem/bench_fp8_sweep.py (.gpu/fp8_sweep.sh on an H200) ---
# class -> (tile, programs per SM that the split aims at; 0: no split): the rule for shapes not in TABLE
DEFAULTS: dict[int, tuple[Tile, float]] = {
    8: (Tile(16, 128, 1, False, True, 4, 4), 2.0),
    16: (Tile(16, 128, 1, False, True, 4, 4), 2.0),
    32: (Tile(32, 128, 1, False, True, 4, 4), 2.0),
    64: (Tile(64, 128, 1, False, True, 4, 4), 1.0),
    128: (Tile(128, 128, 1, False, True, 8, 3), 1.0),
    LARGE: (Tile(64, 128, 1, False, False, 4, 4), 0.0),
}
# (N, K) -> class -> Config, or CUBLAS
TABLE: dict[tuple[int, int], dict[int, Config | None]] = {}
# --- end measured ---


def row_class(M: int) -> int:
    return next((c for c in CLASSES if M <= c), LARGE)


def split_for(N: int, K: int, tile: Tile, cls: int, waves: float, sms: int = SMS) -> int:
    """K splits so that (N / block_n) x (class rows / block_m) x splits ~ waves x sms programs, no empty split."""
    kt = -(-K // BLOCK_K)
    base = -(-N // tile.block_n) * -(-min(cls, CLASSES[-1]) // tile.block_m)
    split = max(1, min(kt, round(waves * sms / base))) if waves > 0 else 1
    tiles = -(-kt // split)
    return -(-kt // tiles)


def cublas_fits(N: int, K: int) -> bool:
    """torch._scaled_mm's blockwise scales want whole 128-blocks (measured only for those)."""
    return N % BLOCK_K == 0 and K % BLOCK_K == 0


def rule(N: int, K: int, cls: int, sms: int = SMS) -> Config:
    """The Triton config of a class for a shape not in TABLE: DEFAULTS' tile, the split from its waves."""
    tile, waves = DEFAULTS[cls]
    return Config(tile, split_for(N, K, tile, cls, waves, sms))


def lookup(N: int, K: int, M: int, sms: int = SMS, cublas: bool = True) -> Config | None:
    """The config of a call with M rows: TABLE's for (N, K) and M's class, else cuBLAS above the last class where
    it fits, else the rule. cublas=False (no CUDA, or fp32 activations) turns CUBLAS into the rule's config."""
    cls = row_class(M)
    per_class = TABLE.get((N, K), {})
    if cls in per_class:
        cfg = per_class[cls]
    else:
        cfg = CUBLAS if cls == LARGE and cublas_fits(N, K) else rule(N, K, cls, sms)
    return rule(N, K, cls, sms) if cfg is CUBLAS and not cublas else cfg
