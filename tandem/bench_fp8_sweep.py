"""`tandem bench fp8-sweep`: tunes the block-scaled fp8 GEMM (kernels/triton_fp8.py) for decode on this GPU (issue 15).

For each weight shape of V2-Lite and DeepSeek-V3 (SHAPES) and each row count in ROWS: every tile of
kernels/triton_fp8_config.TILES that suits the row class (CLASS_BLOCK_M), against F.linear in bf16, torch._scaled_mm
(its activation quantization included) and the fp8 byte floor (weight + scale + activation + output bytes / 4.23
TB/s). A class is searched at one row count (SEARCH: 1 row for the class 1..8, the bound for the others); its winner
is then timed at the class's other row counts. Class 1..8 tries each tile at the K splits that aim at 0 / 1 / 2 / 4
programs per SM (WAVES); its winner's split and MMA kind bind the shape's other classes (only their tiles of that
kind, at that split), so a row keeps its bits from 1 to 128 rows (triton_fp8_config.py). GPU times: CUDA-graph
replays (tandem/bench_fp8.device_time) cycling over weight copies that together exceed the L2 three times, at most
64 (every weight byte from HBM, as in decode). Every candidate is checked against the reference (kernels/fp8.py)
before it is timed; each winner's rows are checked bit for bit against a call with more rows of the same class
(decode vs verify), and every class's first row against class 1..8's. The tiles are compiled first by parallel
processes.

Writes OUT/fp8_sweep.md (tables), OUT/fp8_sweep.json (every time) and OUT/fp8_config.py: kernels/triton_fp8_config.py
with the measured TABLE (per-shape winners) and DEFAULTS (per class, the tile and waves closest to the per-shape
best over all shapes, geometric mean) in place (tandem/bench_fp8_sweep_report.py). No shape is started after
--budget-s. --small: two tiny shapes on CPU under TRITON_INTERPRET=1 (the test).
"""
from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from kernels import fp8, triton_fp8_config as fc
from kernels.triton_fp8_config import CLASSES, Config, Tile
from tandem.bench_fp8 import FLOOR_BW, cycle, device_time

# (model, layer, N, K): the projections, V2-Lite first (issue 15's step time; its q and kv_a as models/ runs them,
# one GEMM), then the fused gate_up / other forms issue 15's plan names
SHAPES = [("V2-Lite", "q|kv_a fused", 3648, 2048), ("V2-Lite", "o", 2048, 2048), ("V2-Lite", "q", 3072, 2048),
          ("V2-Lite", "kv_a", 576, 2048),
          ("V2-Lite", "dense gate|up", 10944, 2048), ("V2-Lite", "dense down", 2048, 10944),
          ("V2-Lite", "shared gate|up", 2816, 2048), ("V2-Lite", "shared down", 2048, 2816),
          ("V3", "q_a", 1536, 7168), ("V3", "q_b", 24576, 1536), ("V3", "kv_a", 576, 7168),
          ("V3", "o_proj", 7168, 16384), ("V3", "dense gate|up", 18432, 7168), ("V3", "dense down", 7168, 18432),
          ("V3", "shared gate|up", 2048, 7168), ("V3", "shared down", 7168, 2048),
          ("V2-Lite", "dense gate_up fused", 21888, 2048), ("V2-Lite", "expert down", 2048, 1408),
          ("V3", "dense gate_up fused", 36864, 7168), ("V3", "shared gate_up fused", 4096, 7168),
          ("V3", "q_a|kv_a fused", 2112, 7168)]
SMALL_SHAPES = [("small", "a", 128, 400), ("small", "b", 64, 256)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
SMALL_ROWS = (1, 3, 16)
SEARCH = {8: 1, 16: 16, 32: 32, 64: 64, 128: 128}      # the row count each class is searched at
CLASS_BLOCK_M = {8: (16,), 16: (16,), 32: (32,), 64: (32, 64), 128: (32, 64, 128)}
WAVES = (0.0, 1.0, 2.0, 4.0)
L2_BYTES = 50 << 20                     # an H200's L2
TOL = 5e-2                              # a candidate further from the reference than this is broken, not rounded


def class_tiles(cls: int, small: bool) -> list[Tile]:
    tiles = [t for t in fc.TILES if t.block_m in CLASS_BLOCK_M[cls]]
    return tiles[:2] if small else tiles


def candidates(N: int, K: int, cls: int, small: bool, sms: int, bound: Config | None = None) -> dict[Config, list]:
    """Every tile of the class at each WAVES' split -> the waves that give it (a split is measured once); bound
    (class 1..8's winner): only the tiles of its MMA kind, at its split (waves [])."""
    out: dict[Config, list[float]] = {}
    for tile in class_tiles(cls, small):
        if bound is not None:
            if fc.wgmma(tile) == fc.wgmma(bound.tile):
                out[Config(tile, bound.split)] = []
            continue
        for waves in (WAVES[:2] if small else WAVES):
            out.setdefault(Config(tile, fc.split_for(N, K, tile, cls, waves, sms)), []).append(waves)
    return out


def copies(make, nbytes: int, device: str) -> list:
    n = min(64, max(2, math.ceil(3 * L2_BYTES / nbytes))) if device.startswith("cuda") else 1
    return [make() for _ in range(n)]


def timed_us(fn, items: list, device: str) -> float:
    calls = max(len(items), 16) if device.startswith("cuda") else 1
    return 1e6 * device_time(cycle(fn, items), device, calls)


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    e = ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    return e if e == e else float("inf")                                     # NaN: broken


def try_time(fn, x, ws, ref, device: str) -> tuple[float | None, float | None, str]:
    """(us, error vs the reference, why not) of fn(x, w, s) over the weight copies; None where it fails."""
    try:
        err = error(fn(x, *ws[0]), ref)
        if err > TOL:
            return None, err, f"error {err:.3g}"
        return timed_us(lambda w: fn(x, *w), ws, device), err, ""
    except Exception as e:                                                   # compile limits, cuBLAS refusals
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return None, None, str(e).splitlines()[0][:120] if str(e) else type(e).__name__


def rows_agree(fn, K: int, cls: int, device: str, dtype) -> bool:
    """Bitwise: the first rows of a call with the class's most rows == calls with fewer rows of the class."""
    lo = max([c for c in CLASSES if c < cls], default=0) + 1
    x = torch.randn(cls, K, device=device).to(dtype)
    full = fn(x)
    return all(torch.equal(fn(x[:m]), full[:m]) for m in sorted({lo, lo + 1, min(lo + 4, cls), cls}))


def measure_shape(shape, a, sms: int) -> dict:
    """Every candidate at the search rows, the winners and the baselines at every row count, of one shape."""
    from kernels.triton_fp8 import fp8_linear_triton, scaled_mm
    _, _, N, K = shape
    dev, dt = a.device, torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    ws = copies(lambda: fp8.quantize_weight(torch.randn(N, K, device=dev, dtype=dt) * 0.02), N * K, dev)
    res = {"shape": list(shape), "copies": len(ws), "rows": {}, "winners": {}}
    for M in (SMALL_ROWS if a.small else ROWS):
        cls = fc.row_class(M)
        x = torch.randn(M, K, device=dev).to(dt)
        ref = fp8.fp8_linear(x.float(), *ws[0])
        scales = 4 * -(-N // fc.BLOCK_K) * -(-K // fc.BLOCK_K)
        row = {"floor_us": 1e6 * (N * K + scales + (K + N) * M * x.element_size()) / FLOOR_BW}
        if dev.startswith("cuda") and fc.cublas_fits(N, K):              # the kernel's CUBLAS classes need it
            row["cublas_us"], _, row["cublas_note"] = try_time(lambda x, w, s: scaled_mm(x, w, s), x, ws, ref, dev)
        if M == SEARCH[cls]:
            row["candidates"] = []
            first = res["winners"].get(CLASSES[0], {})
            bound = winner_config(first) if cls != CLASSES[0] and first.get("kind") == "triton" else None
            for cfg, waves in candidates(N, K, cls, a.small, sms, bound).items():
                us, err, note = try_time(lambda x, w, s: fp8_linear_triton(x, w, s, cfg=cfg), x, ws, ref, dev)
                row["candidates"].append({"tile": list(cfg.tile), "split": cfg.split, "waves": waves, "us": us,
                                          "error": err, "note": note})
            res["winners"][cls] = pick(row, cls)
        win = res["winners"][cls]
        if win["kind"] == "triton" and M != SEARCH[cls]:
            cfg = winner_config(win)
            row["fp8_us"], _, _ = try_time(lambda x, w, s: fp8_linear_triton(x, w, s, cfg=cfg), x, ws, ref, dev)
        else:
            row["fp8_us"] = row.get("cublas_us") if win["kind"] == "cublas" else win["us"]
        res["rows"][M] = row
    bf16_times(res, N, K, dev, dt)
    check_rows(res, ws[0], K, dev, dt)
    return res


def pick(row: dict, cls: int) -> dict:
    """The fastest candidate at the search rows; kind 'none' where everything failed (the shape keeps the default
    rule for that class). Never cuBLAS: its rows change bits with the row count."""
    ok = [c for c in row["candidates"] if c["us"] is not None]
    best = min(ok, key=lambda c: c["us"]) if ok else None
    if best is None:
        return {"kind": "none", "us": None}
    return {"kind": "triton", "tile": best["tile"], "split": best["split"], "waves": best["waves"], "us": best["us"]}


def winner_config(win: dict) -> Config:
    return Config(Tile(*win["tile"]), win["split"])


def bf16_times(res: dict, N: int, K: int, dev: str, dt) -> None:
    wide = copies(lambda: torch.randn(N, K, device=dev, dtype=dt) * 0.02, 2 * N * K, dev)
    for M, row in res["rows"].items():
        x = torch.randn(M, K, device=dev).to(dt)
        row["bf16_us"] = timed_us(lambda w: torch.nn.functional.linear(x, w), wide, dev)


def check_rows(res: dict, w, K: int, dev: str, dt) -> None:
    """Each winner's rows within its class, and every winner's first row against class 1..8's (one row)."""
    from kernels.triton_fp8 import fp8_linear_triton
    x = torch.randn(CLASSES[-1], K, device=dev).to(dt)
    one = None
    for cls, win in sorted(res["winners"].items()):
        if win["kind"] == "triton":
            cfg = winner_config(win)
            win["rows_agree"] = rows_agree(lambda x: fp8_linear_triton(x, *w, cfg=cfg), K, cls, dev, dt)
            row = fp8_linear_triton(x[:cls], *w, cfg=cfg)[:1]
            one = row if one is None else one
            win["rows_across"] = torch.equal(row, one)


def _compile(tile: tuple, split: int) -> tuple[tuple, int, float, str]:
    """One tile compiled (into Triton's on-disk cache) by a real call at a small shape of the same alignment."""
    t0 = time.time()
    try:
        from kernels.triton_fp8 import fp8_linear_triton
        q, s = fp8.quantize_weight(torch.randn(256, 512, device="cuda"))
        x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
        fp8_linear_triton(x, q, s, cfg=Config(Tile(*tile), split))
        torch.cuda.synchronize()
        return tile, split, time.time() - t0, ""
    except Exception as e:
        return tile, split, time.time() - t0, str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def precompile(workers: int) -> list[tuple]:
    """Every tile with its two output dtypes (split 1: x's dtype; split > 1: the fp32 workspace), in parallel."""
    import multiprocessing
    jobs = [(tuple(t), split) for t in fc.TILES for split in (1, 2)]
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile, *zip(*jobs)))


def main(argv=None) -> int:
    from tandem import bench_fp8_sweep_report as report
    p = argparse.ArgumentParser(prog="tandem bench fp8-sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="two tiny shapes, two tiles a class (CPU, the test)")
    p.add_argument("--budget-s", type=float, default=150.0, help="no new shape is started after this many seconds")
    p.add_argument("--workers", type=int, default=16, help="processes compiling the tiles before the sweep")
    p.add_argument("--out", default="results/fp8-sweep")
    a = p.parse_args(argv)
    a.device = "cuda:0" if a.device == "cuda" else a.device
    t0, cuda = time.time(), a.device.startswith("cuda")
    head = {"device": torch.cuda.get_device_name(0) if cuda else a.device, "date": time.strftime("%Y-%m-%d")}
    if cuda:
        from tandem.bench_floor import copy_bandwidth
        head["copy_tb_s"] = copy_bandwidth(a.device, 1 << 30) / 1e12
        try:
            head["compiles"] = precompile(a.workers)
        except Exception as e:                                               # the sweep compiles as it goes
            head["compile_error"] = repr(e)[:300]
        head["compile_s"] = time.time() - t0
        print(f"compiled {len(head.get('compiles', []))} variants in {head['compile_s']:.0f} s; failed: "
              f"{[c[:2] for c in head.get('compiles', []) if c[3]]} {head.get('compile_error', '')}", flush=True)
    from kernels.triton_fp8 import device_sms
    head["sms"], results = device_sms(torch.device(a.device)), []
    for shape in (SMALL_SHAPES if a.small else SHAPES):
        if time.time() - t0 > a.budget_s:
            print(f"budget: {shape} and later shapes not measured", flush=True)
            break
        try:
            results.append(measure_shape(shape, a, head["sms"]))
        except Exception:                                                    # one shape's failure is reported
            import traceback
            traceback.print_exc()
            head.setdefault("failed_shapes", []).append(list(shape))
            continue
        print(report.shape_lines(results[-1]), flush=True)
        head["seconds"] = time.time() - t0
        report.write(a.out, head, results, final=False)                     # a killed run still reports
        if cuda:
            torch.cuda.empty_cache()
    head["seconds"] = time.time() - t0
    report.write(a.out, head, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
