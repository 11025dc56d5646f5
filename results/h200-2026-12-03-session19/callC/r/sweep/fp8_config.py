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
    # fused twins of the decode winners above (one launch: no quantization kernel before them)
    Tile(16, 64, 1, True, True, 4, 6), Tile(16, 32, 1, True, False, 4, 6), Tile(16, 128, 2, True, True, 4, 3),
    Tile(32, 128, 1, False, True, 4, 4), Tile(32, 128, 2, False, True, 4, 3), Tile(32, 128, 1, True, False, 4, 4),
    Tile(32, 128, 1, False, False, 4, 4), Tile(64, 32, 1, False, True, 4, 4),      # mma.sync kind for 32+ rows
    Tile(64, 128, 1, False, True, 4, 4), Tile(64, 128, 2, False, True, 4, 3), Tile(64, 128, 1, False, False, 4, 4),
    Tile(128, 128, 1, False, True, 8, 3), Tile(128, 128, 1, False, False, 8, 3),
)

# --- measured: the block below is written by tandem/bench_fp8_sweep.py (.gpu/fp8_sweep.sh on an H200) ---
# NVIDIA H200, 2026-12-03, 132 SMs: `tandem bench fp8-sweep`, classes searched at 1 / 16 / 32 / 64 / 128 rows
# class -> (tile, programs per SM its split aims at; 0: none; classes 16..128 take class 8's): the rule off TABLE
DEFAULTS: dict[int, tuple[Tile, float]] = {
    8: (Tile(16, 64, 1, False, True, 4, 6), 1.0),  # 1.05x each shape's best (geometric mean, 21 shapes)
    16: (Tile(16, 64, 1, False, True, 4, 6), 0.0),  # 1.04x each shape's best (geometric mean, 21 shapes)
    32: (Tile(32, 128, 1, False, True, 4, 4), 0.0),  # 1.03x each shape's best (geometric mean, 21 shapes)
    64: (Tile(32, 128, 1, False, True, 4, 4), 0.0),  # 1.11x each shape's best (geometric mean, 21 shapes)
    128: (Tile(64, 128, 1, False, True, 4, 4), 0.0),  # 1.13x each shape's best (geometric mean, 21 shapes)
    LARGE: (Tile(64, 128, 1, False, False, 4, 4), 0.0),  # not measured: prefill
}
# (N, K) -> class -> Config, or CUBLAS
TABLE: dict[tuple[int, int], dict[int, Config | None]] = {
    (3648, 2048): {  # V2-Lite q|kv_a fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 8.2 us, bf16 7.0
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 9.6 us, bf16 7.1
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 12.5 us, bf16 7.1
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 2),  # 13.5 us, bf16 7.1
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 2),  # 18.2 us, bf16 7.6
    },
    (2048, 2048): {  # V2-Lite o
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 4),  # 7.4 us, bf16 6.2
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 4),  # 8.0 us, bf16 6.2
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 4),  # 16.3 us, bf16 6.3
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 12.1 us, bf16 6.4
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 16.8 us, bf16 6.8
    },
    (3072, 2048): {  # V2-Lite q
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 8.4 us, bf16 6.6
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 9.5 us, bf16 6.7
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 3),  # 13.0 us, bf16 6.8
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 3),  # 15.2 us, bf16 6.8
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 3),  # 20.8 us, bf16 7.3
    },
    (576, 2048): {  # V2-Lite kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 6),  # 6.6 us, bf16 6.2
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 6),  # 7.1 us, bf16 6.0
        32: Config(Tile(32, 128, 1, True, False, 4, 4), 6),  # 16.3 us, bf16 5.9
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 6),  # 10.8 us, bf16 6.0
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 6),  # 12.4 us, bf16 6.0
    },
    (10944, 2048): {  # V2-Lite dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 11.0 us, bf16 14.1
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 12.2 us, bf16 14.3
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 13.5 us, bf16 14.5
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 13.8 us, bf16 15.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 15.7 us, bf16 15.6
    },
    (2048, 10944): {  # V2-Lite dense down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 8),  # 14.6 us, bf16 17.1
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 8),  # 17.8 us, bf16 17.1
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 22.8 us, bf16 16.8
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 8),  # 30.7 us, bf16 17.3
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 8),  # 43.9 us, bf16 19.2
    },
    (2816, 2048): {  # V2-Lite shared gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 8.3 us, bf16 6.4
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 3),  # 9.4 us, bf16 6.5
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 3),  # 12.3 us, bf16 6.6
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 3),  # 14.2 us, bf16 6.7
        128: Config(Tile(32, 128, 2, False, True, 4, 3), 3),  # 19.4 us, bf16 7.0
    },
    (2048, 2816): {  # V2-Lite shared down
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 4),  # 9.1 us, bf16 8.0
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 4),  # 9.8 us, bf16 8.2
        32: Config(Tile(32, 128, 1, False, False, 4, 4), 4),  # 18.6 us, bf16 8.4
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 15.4 us, bf16 8.4
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 18.4 us, bf16 8.0
    },
    (1536, 7168): {  # V3 q_a
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 10.4 us, bf16 10.9
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 6),  # 12.3 us, bf16 10.9
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 6),  # 17.7 us, bf16 11.1
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 18.9 us, bf16 11.3
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 6),  # 27.3 us, bf16 12.4
    },
    (24576, 1536): {  # V3 q_b
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 14.0 us, bf16 22.2
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 14.8 us, bf16 21.3
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 16.1 us, bf16 21.7
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 16.6 us, bf16 22.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 24.3 us, bf16 24.6
    },
    (576, 7168): {  # V3 kv_a
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 14),  # 8.2 us, bf16 7.9
        16: Config(Tile(16, 32, 1, False, False, 4, 6), 14),  # 9.3 us, bf16 8.1
        32: Config(Tile(32, 128, 1, True, False, 4, 4), 14),  # 26.4 us, bf16 8.7
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 14),  # 15.6 us, bf16 9.1
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 14),  # 19.6 us, bf16 10.2
    },
    (7168, 16384): {  # V3 o_proj
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 2),  # 36.0 us, bf16 60.5
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 2),  # 40.4 us, bf16 64.8
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 2),  # 43.6 us, bf16 63.0
        64: Config(Tile(64, 128, 2, False, True, 4, 3), 2),  # 55.7 us, bf16 63.2
        128: Config(Tile(128, 128, 1, False, False, 8, 3), 2),  # 71.6 us, bf16 69.8
    },
    (18432, 7168): {  # V3 dense gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 37.0 us, bf16 71.5
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 39.5 us, bf16 72.3
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 47.8 us, bf16 71.4
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 48.5 us, bf16 66.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 77.2 us, bf16 69.4
    },
    (7168, 18432): {  # V3 dense down
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 5),  # 40.7 us, bf16 68.5
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 5),  # 48.1 us, bf16 71.7
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 5),  # 63.5 us, bf16 75.9
        64: Config(Tile(64, 128, 1, False, True, 4, 4), 5),  # 77.8 us, bf16 75.5
        128: Config(Tile(64, 128, 1, False, True, 4, 4), 5),  # 110.0 us, bf16 76.3
    },
    (2048, 7168): {  # V3 shared gate|up
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 11.0 us, bf16 12.5
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 13.2 us, bf16 12.7
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 17.2 us, bf16 13.0
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 18.9 us, bf16 13.2
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 24.8 us, bf16 15.0
    },
    (7168, 2048): {  # V3 shared down
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 9.2 us, bf16 10.1
        16: Config(Tile(16, 64, 4, False, True, 4, 3), 1),  # 10.2 us, bf16 10.1
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 12.5 us, bf16 10.1
        64: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 12.6 us, bf16 10.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 13.3 us, bf16 10.2
    },
    (21888, 2048): {  # V2-Lite dense gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 1),  # 15.8 us, bf16 24.1
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 1),  # 16.6 us, bf16 24.9
        32: Config(Tile(32, 128, 1, False, True, 4, 4), 1),  # 18.3 us, bf16 25.6
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 18.9 us, bf16 27.0
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 28.7 us, bf16 30.0
    },
    (2048, 1408): {  # V2-Lite expert down
        8: Config(Tile(16, 32, 1, False, False, 4, 6), 4),  # 7.8 us, bf16 5.3
        16: Config(Tile(16, 32, 1, True, False, 4, 6), 4),  # 8.2 us, bf16 5.5
        32: Config(Tile(32, 128, 1, True, False, 4, 4), 4),  # 15.9 us, bf16 5.4
        64: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 13.3 us, bf16 5.5
        128: Config(Tile(64, 32, 1, False, True, 4, 4), 4),  # 16.4 us, bf16 5.8
    },
    (36864, 7168): {  # V3 dense gate_up fused
        8: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 70.0 us, bf16 135.6
        16: Config(Tile(16, 128, 1, False, True, 4, 4), 1),  # 70.5 us, bf16 137.4
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 1),  # 94.7 us, bf16 139.0
        64: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 96.2 us, bf16 134.4
        128: Config(Tile(64, 128, 1, False, False, 4, 4), 1),  # 122.0 us, bf16 135.2
    },
    (4096, 7168): {  # V3 shared gate_up fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 14.0 us, bf16 20.8
        16: Config(Tile(16, 128, 2, False, True, 4, 3), 4),  # 17.0 us, bf16 21.1
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 20.1 us, bf16 20.6
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 25.9 us, bf16 18.5
        128: Config(Tile(64, 128, 1, False, True, 4, 4), 4),  # 38.6 us, bf16 20.9
    },
    (2112, 7168): {  # V3 q_a|kv_a fused
        8: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 11.4 us, bf16 13.7
        16: Config(Tile(16, 64, 1, False, True, 4, 6), 4),  # 13.9 us, bf16 13.5
        32: Config(Tile(32, 128, 2, False, True, 4, 3), 4),  # 17.6 us, bf16 13.9
        64: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 23.0 us, bf16 14.3
        128: Config(Tile(32, 128, 1, False, True, 4, 4), 4),  # 28.6 us, bf16 14.5
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
