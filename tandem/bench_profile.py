"""`tandem bench profile`: where a round's time goes on the host and on the device.

The served round in one process (tandem/bench_inprocess.py: the gateway's Scheduler over this process's
target and draft servicers, CUDA graphs as the services capture them), per (batch, K): one warm-up pass,
then one pass under cProfile (Python: which functions hold the host) and one under torch.profiler (which
operators the host launches and how long the device is busy). Per case it writes OUT/profile-bB-kK.txt:
wall per round, device-busy per round (the sum of kernel times, an upper bound on what overlaps), the
top functions by own time and by cumulative time, and the top operators by host and device time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from tandem.bench_inprocess import make_engines, random_id, run_loop


def profile_case(te, de, prompts, k: int, batch: int, max_tokens: int, top: int) -> str:
    run_loop(te, de, prompts[:batch], k, batch, max_tokens)                   # warm-up (and graph buckets)
    prof = cProfile.Profile()
    prof.enable()
    r = run_loop(te, de, prompts, k, batch, max_tokens)
    prof.disable()
    py = io.StringIO()
    stats = pstats.Stats(prof, stream=py).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                     if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as tp:
        r2 = run_loop(te, de, prompts, k, batch, max_tokens)
    ev = tp.key_averages()
    device_us = sum(e.self_device_time_total for e in ev) if torch.cuda.is_available() else 0.0
    ops = ev.table(sort_by="self_cpu_time_total", row_limit=top)
    dev = ev.table(sort_by="self_device_time_total", row_limit=top) if torch.cuda.is_available() else ""
    head = (f"batch {batch}, K {k}: {r.rounds} rounds, {r.tokens} tokens, wall {1000 * r.wall_s / r.rounds:.2f} ms "
            f"a round without a profiler (split ms: {', '.join(f'{n} {1000 * s / r.rounds:.2f}' for n, s in r.split.items())}); "
            f"under torch.profiler {1000 * r2.wall_s / r2.rounds:.2f} ms a round, device busy "
            f"{device_us / 1000 / r2.rounds:.2f} ms a round (kernel time summed)\n")
    return "\n".join([head, "== Python: own time, then cumulative ==", py.getvalue(),
                      "== operators by host time ==", ops, "== operators by device time ==", dev])


def main(argv=None) -> int:
    from models.tiny import default_model
    from tandem.bench import bench_prompts
    p = argparse.ArgumentParser(prog="tandem bench profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--random-config", default="", help="a models/presets.py preset with random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda (target cuda:0, draft cuda:1 if present)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default="auto", help="auto | none | fp8 (tandem serve --help)")
    p.add_argument("--synthetic-acceptance", default="", help="BENCHMARK ONLY: per-position acceptance, e.g. 0.85")
    p.add_argument("--ks", default="0,3")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--out", default="results/profile")
    a = p.parse_args(argv)
    from services.target.synthetic import parse_profile
    model = random_id(a) or str(a.model or default_model())
    te, de = make_engines(model, a.device, a.dtype, synthetic_acceptance=parse_profile(a.synthetic_acceptance),
                          quantization=a.quantization)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for b in (int(x) for x in a.batches.split(",")):
        prompts = bench_prompts(model, b, a.prompt_tokens, seed=b)
        for k in (int(x) for x in a.ks.split(",")):
            t0 = time.perf_counter()
            text = profile_case(te, de, prompts, k, b, a.max_tokens, a.top)
            (Path(a.out) / f"profile-b{b}-k{k}.txt").write_text(text)
            print(text.splitlines()[0], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0
