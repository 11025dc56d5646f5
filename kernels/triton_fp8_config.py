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
# NVIDIA H200, 2026-12-01, 132 SMs: `tandem bench fp8-sweep`, classes searched at 1 / 16 / 32 / 64 / 128 rows
# class -> (tile, programs per SM that the split aims at; 0: no split): the rule for shapes not in TABLE
DEFAULTS: dict[int, tuple[Tile, float]] = {
    8: (Tile(16, 64, 1, False, True, 4, 6), 1.0),  # 1.05x each shape's best (geometric mean, 19 shapes)
    16: (Tile(16, 128, 2, False, True, 4, 3), 1.0),  # 1.08x each shape's best (geometric mean, 19 shapes)
    32: (Tile(32, 128, 1, False, True, 4, 4), 1.0),  # 1.03x each shape's best (geometric mean, 19 shapes)
    64: (Tile(64, 128, 1, False, False, 4, 4), 1.0),  # 1.01x each shape's best (geometric mean, 19 shapes)
    128: (Tile(64, 128, 1, False, False, 4, 4), 1.0),  # 1.04x each shape's best (geometric mean, 19 shapes)
    LARGE: (Tile(64, 128, 1, False, False, 4, 4), 0.0),  # not measured: prefill
}
# (N, K) -> class -> Config, or CUBLAS
TABLE: dict[tuple[int, int], dict[int, Config | None]] = {
    (3072, 2048): {  # V2-Lite q
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 8.4 us, bf16 6.6
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 9.2 us, bf16 6.6
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 10.5 us, bf16 6.7
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 6),  # 11.3 us, bf16 6.9
        128: CUBLAS,  # 11.4 us, bf16 7.1
    },
    (576, 2048): {  # V2-Lite kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 6),  # 6.9 us, bf16 6.1
        16: Config(Tile(16, 64, 2, True, False, 4, 4), 8),  # 7.3 us, bf16 5.8
        32: Config(Tile(32, 128, 1, True, False, 4, 4), 16),  # 9.5 us, bf16 5.8
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 16),  # 10.3 us, bf16 5.8
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 9.4 us, bf16 6.0
    },
    (2048, 2048): {  # V2-Lite o
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 7.5 us, bf16 6.2
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 7.9 us, bf16 6.2
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 9.3 us, bf16 6.2
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 10.2 us, bf16 6.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 10.8 us, bf16 6.8
    },
    (10944, 2048): {  # V2-Lite dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 10.4 us, bf16 13.8
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 12.0 us, bf16 14.0
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 13.0 us, bf16 14.3
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 14.0 us, bf16 15.1
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 15.9 us, bf16 15.4
    },
    (2048, 10944): {  # V2-Lite dense down
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 8),  # 14.6 us, bf16 17.1
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 8),  # 15.3 us, bf16 16.9
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 16.5 us, bf16 16.5
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 17.6 us, bf16 17.3
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 21.5 us, bf16 19.6
    },
    (2816, 2048): {  # V2-Lite shared gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 8.0 us, bf16 6.4
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 8.5 us, bf16 6.4
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 9.6 us, bf16 6.4
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 6),  # 10.9 us, bf16 6.7
        128: CUBLAS,  # 11.4 us, bf16 6.9
    },
    (2048, 2816): {  # V2-Lite shared down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 9.3 us, bf16 7.9
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 9.5 us, bf16 8.1
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 10.8 us, bf16 8.3
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 11.7 us, bf16 8.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 12.3 us, bf16 7.5
    },
    (1536, 7168): {  # V3 q_a
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 10.3 us, bf16 10.9
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 11.3 us, bf16 10.8
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 10),  # 12.3 us, bf16 11.0
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 10),  # 13.2 us, bf16 11.3
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 6),  # 15.8 us, bf16 12.4
    },
    (24576, 1536): {  # V3 q_b
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 13.9 us, bf16 21.5
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 14.8 us, bf16 20.7
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 16.0 us, bf16 20.9
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 16.7 us, bf16 21.9
        128: CUBLAS,  # 18.3 us, bf16 24.2
    },
    (576, 7168): {  # V3 kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 7),  # 8.7 us, bf16 7.9
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 7),  # 9.9 us, bf16 7.5
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 19),  # 11.8 us, bf16 8.8
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 19),  # 12.6 us, bf16 9.2
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 12),  # 12.6 us, bf16 10.3
    },
    (7168, 16384): {  # V3 o_proj
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 35.3 us, bf16 63.5
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 5),  # 36.6 us, bf16 64.0
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 42.7 us, bf16 62.4
        64: CUBLAS,  # 50.4 us, bf16 63.1
        128: CUBLAS,  # 51.8 us, bf16 69.7
    },
    (18432, 7168): {  # V3 dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 35.9 us, bf16 69.5
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 37.9 us, bf16 69.6
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 46.0 us, bf16 69.0
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 47.4 us, bf16 63.7
        128: CUBLAS,  # 53.8 us, bf16 66.6
    },
    (7168, 18432): {  # V3 dense down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 39.3 us, bf16 67.6
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 5),  # 41.0 us, bf16 70.6
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 47.3 us, bf16 73.8
        64: CUBLAS,  # 55.6 us, bf16 74.0
        128: CUBLAS,  # 57.5 us, bf16 75.1
    },
    (2048, 7168): {  # V3 shared gate|up
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 8),  # 11.2 us, bf16 12.6
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 8),  # 12.1 us, bf16 12.8
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 12.9 us, bf16 13.0
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 14.2 us, bf16 13.6
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 16.5 us, bf16 15.0
    },
    (7168, 2048): {  # V3 shared down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 9.1 us, bf16 10.2
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 10.9 us, bf16 10.0
        32: CUBLAS,  # 11.5 us, bf16 10.0
        64: CUBLAS,  # 11.6 us, bf16 10.5
        128: CUBLAS,  # 11.9 us, bf16 10.2
    },
    (21888, 2048): {  # V2-Lite dense gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 15.8 us, bf16 24.4
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 16.7 us, bf16 25.2
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 18.3 us, bf16 25.4
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 19.4 us, bf16 26.6
        128: CUBLAS,  # 21.4 us, bf16 28.9
    },
    (2048, 1408): {  # V2-Lite expert down
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 1),  # 7.7 us, bf16 5.3
        16: Config(Tile(16, 128, 1, True, True, 4, 4), 6),  # 7.7 us, bf16 5.2
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 9.4 us, bf16 5.3
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 6),  # 10.1 us, bf16 5.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 10.9 us, bf16 5.7
    },
    (36864, 7168): {  # V3 dense gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 67.1 us, bf16 130.5
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 66.8 us, bf16 132.3
        32: CUBLAS,  # 87.1 us, bf16 134.5
        64: CUBLAS,  # 82.6 us, bf16 127.9
        128: CUBLAS,  # 87.1 us, bf16 130.8
    },
    (4096, 7168): {  # V3 shared gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 14.1 us, bf16 20.2
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 4),  # 15.5 us, bf16 20.4
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 16.6 us, bf16 20.2
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 18.7 us, bf16 18.1
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 22.3 us, bf16 21.4
    },
}
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
