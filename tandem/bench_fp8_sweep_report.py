"""What `tandem bench fp8-sweep` (tandem/bench_fp8_sweep.py) writes: OUT/fp8_sweep.md (the winners against bf16,
cuBLAS and the floor; every tile's best time per shape; the fitted defaults), OUT/fp8_sweep.json (every number)
and OUT/fp8_config.py, kernels/triton_fp8_config.py with its measured block replaced (checked by running it)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from kernels import triton_fp8_config as fc
from kernels.triton_fp8_config import CLASSES, LARGE, Tile

BEGIN, END = "# --- measured:", "# --- end measured ---"


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def tile_name(t) -> str:
    t = Tile(*t)
    return (f"{t.block_m}x{t.block_n} k{t.kstep} {'fused' if t.fused else 'pre'} {'swap' if t.swap else 'std'} "
            f"w{t.warps}s{t.stages}")


def winner_name(win: dict) -> str:
    if win["kind"] == "triton":
        return f"{tile_name(win['tile'])} split {win['split']}"
    return "cuBLAS" if win["kind"] == "cublas" else "none ran"


def row_line(res: dict, M: int) -> str:
    model, layer, N, K = res["shape"]
    r, win = res["rows"][M], res["winners"][fc.row_class(M)]
    fp8, bf16 = r.get("fp8_us"), r.get("bf16_us")
    return (f"| {model} | {layer} | {N}x{K} | {M} | {fmt(fp8)} | {winner_name(win)} | {fmt(bf16)} | "
            f"{fmt(r.get('cublas_us'))} | {fmt(r['floor_us'])} | {fmt(fp8 and fp8 / r['floor_us'], '.2f')} | "
            f"{fmt(fp8 and bf16 and bf16 / fp8, '.2f')} |")


ROW_HEAD = ("| model | layer | N x K | rows | fp8 us | config (winner of the class) | bf16 us | _scaled_mm us | "
            "floor us | fp8 / floor | bf16 / fp8 |\n|---|---|---|---|---|---|---|---|---|---|---|")


def shape_lines(res: dict) -> str:
    return "\n".join(row_line(res, M) for M in res["rows"])


def searched(res: dict, cls: int) -> list[dict]:
    """The candidates that ran at the class's search rows."""
    return [c for M, r in res["rows"].items() if fc.row_class(M) == cls for c in r.get("candidates", [])
            if c["us"] is not None]


def best_per_tile(res: dict, cls: int) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for c in searched(res, cls):
        key = tuple(c["tile"])
        if key not in out or c["us"] < out[key]["us"]:
            out[key] = c
    return out


def fit_defaults(results: list[dict]) -> dict[int, tuple[Tile, float, float]]:
    """Per class, the (tile, waves) whose times over every measured shape are closest to each shape's best
    (geometric mean of the ratios), with that mean: the rule for shapes that TABLE does not list. Classes above 1..8
    choose among the tiles of class 1..8's MMA kind (over the shapes of that kind; their split is class 1..8's)."""
    fitted = {}
    for cls in CLASSES:
        ratios: dict[tuple, list[float]] = {}
        shapes = 0
        kind = fc.wgmma(fitted[CLASSES[0]][0]) if cls != CLASSES[0] and CLASSES[0] in fitted else None
        for res in results:
            cands = [c for c in searched(res, cls) if kind is None or fc.wgmma(Tile(*c["tile"])) == kind]
            if cands:
                shapes += 1
                best = min(c["us"] for c in cands)
                for c in cands:
                    for waves in c["waves"] or [0.0]:             # bound classes: class 1..8's split
                        ratios.setdefault((tuple(c["tile"]), waves), []).append(math.log(c["us"] / best))
        full = {k: sum(v) / len(v) for k, v in ratios.items() if len(v) == shapes}
        if full:
            (tile, waves), score = min(full.items(), key=lambda kv: kv[1])
            fitted[cls] = (Tile(*tile), waves, math.exp(score))
    return fitted


def _tile_src(t) -> str:
    t = Tile(*t)
    return f"Tile({t.block_m}, {t.block_n}, {t.kstep}, {t.fused}, {t.swap}, {t.warps}, {t.stages})"


def measured_block(head: dict, results: list[dict], fitted: dict) -> str:
    """The DEFAULTS and TABLE literals of kernels/triton_fp8_config.py, from BEGIN's line to END's."""
    lines = [f"{BEGIN} the block below is written by tandem/bench_fp8_sweep.py (.gpu/fp8_sweep.sh on an H200) ---",
             f"# {head['device']}, {head['date']}, {head['sms']} SMs: `tandem bench fp8-sweep`, classes searched at "
             "1 / 16 / 32 / 64 / 128 rows",
             "# class -> (tile, programs per SM its split aims at; 0: none; classes 16..128 take class 8's): "
             "the rule off TABLE",
             "DEFAULTS: dict[int, tuple[Tile, float]] = {"]
    for cls in (*CLASSES, LARGE):
        tile, waves = fc.DEFAULTS[cls]
        note = "  # not measured: prefill" if cls == LARGE else "  # not measured: the shipped rule"
        if cls in fitted:
            tile, waves, score = fitted[cls]
            note = f"  # {score:.2f}x each shape's best (geometric mean, {len(results)} shapes)"
        lines.append(f"    {'LARGE' if cls == LARGE else cls}: ({_tile_src(tile)}, {waves}),{note}")
    lines += ["}", "# (N, K) -> class -> Config, or CUBLAS",
              "TABLE: dict[tuple[int, int], dict[int, Config | None]] = {"]
    for res in results:
        model, layer, N, K = res["shape"]
        lines.append(f"    ({N}, {K}): {{  # {model} {layer}")
        for cls, win in sorted(res["winners"].items()):
            if win["kind"] == "none":
                continue
            src = "CUBLAS" if win["kind"] == "cublas" else f"Config({_tile_src(win['tile'])}, {win['split']})"
            row = next(r for M, r in res["rows"].items() if fc.row_class(M) == cls and "candidates" in r)
            lines.append(f"        {cls}: {src},  # {win['us']:.1f} us, bf16 {fmt(row.get('bf16_us'))}")
        lines.append("    },")
    return "\n".join(lines + ["}", END])


def config_module(head: dict, results: list[dict], fitted: dict) -> str:
    """kernels/triton_fp8_config.py with the measured block replaced; run once to prove it loads."""
    text = Path(fc.__file__).read_text()
    a, b = text.index(BEGIN), text.index(END) + len(END)
    text = text[:a] + measured_block(head, results, fitted) + text[b:]
    ns: dict = {"__name__": "fp8_config_check"}
    exec(compile(text, "fp8_config.py", "exec"), ns)
    for res in results:
        table = ns["TABLE"][tuple(res["shape"][2:])]
        assert all(table[c] is None or table[c].tile in fc.TILES for c in table), table
    return text


def candidate_table(results: list[dict], cls: int) -> str:
    tiles = sorted({t for res in results for t in best_per_tile(res, cls)})
    if not tiles:
        return ""
    head = "| shape | " + " | ".join(tile_name(t) for t in tiles) + " |\n|---|" + "---|" * len(tiles)
    lines = []
    for res in results:
        best = best_per_tile(res, cls)
        cells = [f"{best[t]['us']:.1f} (s{best[t]['split']})" if t in best else "-" for t in tiles]
        lines.append(f"| {res['shape'][0]} {res['shape'][1]} | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(lines)


def sums(results: list[dict]) -> list[str]:
    """Per model and row count: the fp8 GEMMs' time over bf16's, one layer of each kind."""
    out = []
    for model in dict.fromkeys(res["shape"][0] for res in results):
        for M in results[0]["rows"]:
            rows = [res["rows"][M] for res in results if res["shape"][0] == model and M in res["rows"]]
            if all(r.get("fp8_us") and r.get("bf16_us") for r in rows):
                fp8, bf16 = sum(r["fp8_us"] for r in rows), sum(r["bf16_us"] for r in rows)
                floor = sum(r["floor_us"] for r in rows)
                out.append(f"| {model} | {M} | {fp8:.1f} | {bf16:.1f} | {floor:.1f} | {fp8 / bf16:.2f} |")
    return out


def write(out: str, head: dict, results: list[dict], final: bool = True) -> None:
    """The three files (again after each shape: a run killed later still leaves them); printed when final."""
    fitted = fit_defaults(results)
    module = config_module(head, results, fitted)
    agree = [(res["shape"][1], cls, win.get("rows_agree")) for res in results for cls, win in res["winners"].items()
             if win["kind"] == "triton"]
    across = [(res["shape"][1], cls, win.get("rows_across")) for res in results
              for cls, win in res["winners"].items() if win["kind"] == "triton"]
    md = [f"# fp8 GEMM sweep: {head['device']}, {head['date']}", "",
          f"{head['sms']} SMs; copy bandwidth {fmt(head.get('copy_tb_s'), '.2f')} TB/s (floor: 4.23 TB/s); "
          f"{len(head.get('compiles', []))} variants compiled in {fmt(head.get('compile_s'), '.0f')} s "
          f"(failed: {[tile_name(c[0]) + f' split {c[1]}: ' + c[3] for c in head.get('compiles', []) if c[3]]}); "
          f"sweep {head['seconds']:.0f} s; {len(results)} shapes (failed: {head.get('failed_shapes', [])}).", "",
          f"Rows bit-identical within their class (decode vs verify) for every Triton winner: "
          f"{all(a for *_, a in agree)} ({sum(1 for *_, a in agree if a)}/{len(agree)}; failing: "
          f"{[x[:2] for x in agree if not x[2]]}); every class's first row equal to class 1..8's (one MMA kind and "
          f"one split a shape): {all(a for *_, a in across)} ({sum(1 for *_, a in across if a)}/{len(across)}; "
          f"failing: {[x[:2] for x in across if not x[2]]}).", "", "## Winners", "", ROW_HEAD]
    md += [shape_lines(res) for res in results]
    md += ["", "## One layer of each kind: sum of GEMM times", "",
           "| model | rows | fp8 us | bf16 us | floor us | fp8 / bf16 |", "|---|---|---|---|---|---|", *sums(results)]
    md += ["", "## Defaults fitted over the shapes", ""]
    md += [f"- class {c}: {tile_name(t)}, {w} programs per SM: {s:.2f}x the best" for c, (t, w, s) in fitted.items()]
    for cls in CLASSES:
        table = candidate_table(results, cls)
        if table:
            md += ["", f"## Class {cls} rows: each tile's best us over its splits (sN: the split)", "", table]
    text = "\n".join(md) + "\n"
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "fp8_sweep.md").write_text(text)
    (path / "fp8_sweep.json").write_text(json.dumps({"head": head, "results": results}, indent=1))
    (path / "fp8_config.py").write_text(module)
    if final:
        print(text + f"wrote {path / 'fp8_sweep.md'}, fp8_sweep.json, fp8_config.py", flush=True)
