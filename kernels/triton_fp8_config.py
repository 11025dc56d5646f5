"""How the block-scaled fp8 GEMM (kernels/triton_fp8.py) runs each call: tile, K split, warps and stages per weight
shape (N, K) and row class, measured on an H200 by `.gpu/fp8_sweep.sh` (tandem/bench_fp8_sweep.py writes TABLE);
shapes not in TABLE get `rule`, DEFAULTS' tile per class.

Rows that do not depend on their neighbours (lossless speculative decoding at any batch): a call with M rows runs
the config of its class, the smallest bound in CLASSES >= M (LARGE above the last). What sets a row's bits was
measured on the H200 (BENCHMARKS.md "Lossless at any batch"): only the K split and the MMA kind (`wgmma`: Hopper's
warpgroup MMA, used where the MMA's long side, block_n when swapped else block_m, is >= 64 with 4 or 8 warps; else
mma.sync), not block_m / block_n / kstep / stages / fused quantization, nor M. So every decode class (1..128 rows)
of a shape runs one MMA kind and one split (`invariant` checks it; the sweep keeps it), and decode (B rows) and
verify (B (K + 1) rows) give a request's row the same bits up to 128 rows a step. LARGE (prefill chunks, cuBLAS
where it fits) keeps no such promise. Imports no torch (the tables are plain data).
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
    Tile(32, 128, 1, False, False, 4, 4), Tile(64, 32, 1, False, True, 4, 4),      # mma.sync kind for 32+ rows
    Tile(64, 128, 1, False, True, 4, 4), Tile(64, 128, 2, False, True, 4, 3), Tile(64, 128, 1, False, False, 4, 4),
    Tile(128, 128, 1, False, True, 8, 3), Tile(128, 128, 1, False, False, 8, 3),
)

# --- measured: the block below is written by tandem/bench_fp8_sweep.py (.gpu/fp8_sweep.sh on an H200) ---
# NVIDIA H200, 2026-12-01, 132 SMs: `tandem bench fp8-sweep`, classes searched at 1 / 16 / 32 / 64 / 128 rows
# class -> (tile, programs per SM its split aims at; 0: none; classes 16..128 take class 8's): the rule off TABLE
DEFAULTS: dict[int, tuple[Tile, float]] = {
    8: (Tile(16, 64, 1, False, True, 4, 6), 1.0),  # 1.04x each shape's best (geometric mean, 19 shapes)
    16: (Tile(16, 128, 2, False, True, 4, 3), 0.0),  # 1.03x each shape's best (geometric mean, 19 shapes)
    32: (Tile(32, 128, 2, False, True, 4, 3), 0.0),  # 1.05x each shape's best (geometric mean, 19 shapes)
    64: (Tile(64, 128, 1, False, False, 4, 4), 0.0),  # 1.03x each shape's best (geometric mean, 19 shapes)
    128: (Tile(64, 128, 1, False, False, 4, 4), 0.0),  # 1.01x each shape's best (geometric mean, 19 shapes)
    LARGE: (Tile(64, 128, 1, False, False, 4, 4), 0.0),  # not measured: prefill
}
# (N, K) -> class -> Config, or CUBLAS
TABLE: dict[tuple[int, int], dict[int, Config | None]] = {
    (3072, 2048): {  # V2-Lite q
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 8.1 us, bf16 6.5
        16: Config(Tile(16, 64, 4, False, True, 4, 3), 1),  # 9.8 us, bf16 6.5
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 11.1 us, bf16 6.6
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 11.4 us, bf16 6.8
        128: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 11.5 us, bf16 7.0
    },
    (576, 2048): {  # V2-Lite kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 6),  # 6.9 us, bf16 6.2
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 6),  # 7.4 us, bf16 5.9
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 6),  # 9.5 us, bf16 5.9
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 6),  # 8.7 us, bf16 5.9
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 6),  # 9.6 us, bf16 6.0
    },
    (2048, 2048): {  # V2-Lite o
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 7.6 us, bf16 6.3
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 8.0 us, bf16 6.4
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 9.1 us, bf16 6.5
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 9.5 us, bf16 6.6
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 10.8 us, bf16 6.9
    },
    (10944, 2048): {  # V2-Lite dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 10.7 us, bf16 14.2
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 12.1 us, bf16 14.4
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 13.3 us, bf16 14.7
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 14.3 us, bf16 15.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 16.4 us, bf16 15.5
    },
    (2048, 10944): {  # V2-Lite dense down
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 8),  # 15.0 us, bf16 17.3
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 8),  # 15.8 us, bf16 17.1
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 16.8 us, bf16 16.8
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 8),  # 17.8 us, bf16 17.6
        128: Config(Tile(128, 128, 1, False, False, 8, 3), 8),  # 21.5 us, bf16 19.6
    },
    (2816, 2048): {  # V2-Lite shared gate|up
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 1),  # 8.2 us, bf16 6.6
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 1),  # 9.9 us, bf16 6.7
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 1),  # 13.1 us, bf16 6.7
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 1),  # 12.7 us, bf16 6.8
        128: Config(Tile(32, 128, 1, False, False, 4, 4), 1),  # 13.4 us, bf16 7.1
    },
    (2048, 2816): {  # V2-Lite shared down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 9.2 us, bf16 8.0
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 9.5 us, bf16 8.2
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 11.0 us, bf16 8.4
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 11.2 us, bf16 8.6
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 12.4 us, bf16 7.6
    },
    (1536, 7168): {  # V3 q_a
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 10.5 us, bf16 10.9
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 11.4 us, bf16 11.0
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 6),  # 12.9 us, bf16 11.1
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 14.0 us, bf16 11.2
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 6),  # 15.8 us, bf16 12.6
    },
    (24576, 1536): {  # V3 q_b
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 14.1 us, bf16 22.0
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 15.1 us, bf16 21.3
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 16.3 us, bf16 21.6
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 17.1 us, bf16 22.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 25.8 us, bf16 24.6
    },
    (576, 7168): {  # V3 kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 7),  # 8.7 us, bf16 7.9
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 7),  # 9.8 us, bf16 8.1
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 7),  # 12.7 us, bf16 8.7
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 7),  # 11.8 us, bf16 9.0
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 7),  # 13.5 us, bf16 9.7
    },
    (7168, 16384): {  # V3 o_proj
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 36.3 us, bf16 60.6
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 2),  # 40.0 us, bf16 65.5
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 43.2 us, bf16 63.1
        64: Config(Tile(64, 128, 2, False, True, 4, 3), 2),  # 51.7 us, bf16 63.6
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 2),  # 60.2 us, bf16 69.8
    },
    (18432, 7168): {  # V3 dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 36.9 us, bf16 70.5
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 39.1 us, bf16 71.3
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 46.6 us, bf16 70.4
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 48.2 us, bf16 65.6
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 80.2 us, bf16 68.6
    },
    (7168, 18432): {  # V3 dense down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 40.1 us, bf16 69.4
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 2),  # 44.0 us, bf16 72.0
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 47.4 us, bf16 76.6
        64: Config(Tile(64, 128, 2, False, True, 4, 3), 2),  # 56.8 us, bf16 75.3
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 2),  # 66.6 us, bf16 76.4
    },
    (2048, 7168): {  # V3 shared gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 11.1 us, bf16 12.7
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 12.8 us, bf16 12.8
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 14.3 us, bf16 13.1
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 14.9 us, bf16 13.2
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 16.8 us, bf16 15.1
    },
    (7168, 2048): {  # V3 shared down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 8.9 us, bf16 10.2
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 10.9 us, bf16 10.2
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 12.0 us, bf16 10.1
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 12.3 us, bf16 10.5
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 13.6 us, bf16 10.3
    },
    (21888, 2048): {  # V2-Lite dense gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 15.8 us, bf16 24.9
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 16.9 us, bf16 25.7
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 18.5 us, bf16 26.1
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 19.5 us, bf16 26.9
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 30.1 us, bf16 29.6
    },
    (2048, 1408): {  # V2-Lite expert down
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 1),  # 7.9 us, bf16 5.4
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 1),  # 8.6 us, bf16 5.4
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 1),  # 11.1 us, bf16 5.4
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 1),  # 10.9 us, bf16 5.6
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 1),  # 11.1 us, bf16 5.8
    },
    (36864, 7168): {  # V3 dense gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 69.4 us, bf16 136.0
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 70.2 us, bf16 137.0
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 91.6 us, bf16 138.9
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 98.6 us, bf16 133.2
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 127.9 us, bf16 134.4
    },
    (4096, 7168): {  # V3 shared gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 14.2 us, bf16 20.4
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 4),  # 15.8 us, bf16 20.7
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 16.9 us, bf16 20.8
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 18.8 us, bf16 18.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 4),  # 22.7 us, bf16 21.7
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


def cublas_fits(N: int, K: int, M: int = 4) -> bool:
    """Where torch._scaled_mm's blockwise path is right on the H200 image (torch 2.11, CUDA 13), measured
    (BENCHMARKS.md "Lossless at any batch"): M a multiple of 4 (else CUBLAS_STATUS_NOT_SUPPORTED), K a multiple of 4
    scale blocks (K = 128, 256, 768, 1408 return garbage: errors 0.1 to 2.7e3) and N >= 1024 (the widths checked)."""
    return N % BLOCK_K == 0 and N >= 1024 and K % (4 * BLOCK_K) == 0 and M % 4 == 0


def wgmma(tile: Tile) -> bool:
    """Whether the tile's dot runs Hopper's warpgroup MMA (its long side >= 64 rows, whole warpgroups): one of the
    two things besides the split that set a row's bits."""
    return (tile.block_n if tile.swap else tile.block_m) >= 64 and tile.warps % 4 == 0


def rule(N: int, K: int, cls: int, sms: int = SMS) -> Config:
    """The Triton config of a class for a shape not in TABLE: DEFAULTS' tile; every decode class takes the split
    of class 8 (from its waves), so the shape's rows keep their bits from 1 to 128 rows (DEFAULTS share one MMA
    kind); LARGE its own waves."""
    tile, waves = DEFAULTS[cls]
    if cls == LARGE:
        return Config(tile, split_for(N, K, tile, cls, waves, sms))
    tile8, waves8 = DEFAULTS[CLASSES[0]]
    return Config(tile, split_for(N, K, tile8, CLASSES[0], waves8, sms))


def invariant(N: int, K: int, sms: int = SMS) -> bool:
    """Every decode class of (N, K) runs Triton with one MMA kind and one split (rows keep their bits)."""
    cfgs = [lookup(N, K, c, sms) for c in CLASSES]
    return all(c is not CUBLAS for c in cfgs) and len({(wgmma(c.tile), c.split) for c in cfgs}) == 1


def lookup(N: int, K: int, M: int, sms: int = SMS, cublas: bool = True) -> Config | None:
    """The config of a call with M rows: TABLE's for (N, K) and M's class, else cuBLAS above the last class where
    it fits, else the rule. cublas=False (no CUDA, or fp32 activations) turns CUBLAS into the rule's config."""
    cls = row_class(M)
    per_class = TABLE.get((N, K), {})
    if cls in per_class:
        cfg = per_class[cls]
    else:
        cfg = CUBLAS if cls == LARGE and cublas_fits(N, K, M) else rule(N, K, cls, sms)
    return rule(N, K, cls, sms) if cfg is CUBLAS and not cublas else cfg
