"""`tandem bench speed`: decode tokens/s of the served cluster per (K, batch) with ratios against K = 0 in the
same run, and where each round's time goes: propose (the Propose RPC wall, of which the draft's bridge transfer
and its compute), verify (the Verify RPC wall, of which the target's compute) and gateway (the rest), read from
the gateway's `tandem:round_phase_seconds` around each measured run. --in-process runs the same grid in one
process too (tandem/bench_inprocess.py; on a CPU between the served repeats): served / in-process tokens/s is the
cost of the split. Each row gives its roofline (tandem/roofline.py): the ideal round (byte floors of the verify
step and of K draft steps at that batch and context, at the copy bandwidth measured in the same run), the tokens/s
it allows at the measured acceptance length, and the fraction reached. --synthetic-acceptance may be given
several times (a cluster per profile): a constant, and a per-position profile like DeepSeek-R1's MTP runs.

    tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 \
        --synthetic-acceptance 0.92,0.72,0.36 --ks 0,3 --batches 1,32

Adaptive speculation (gateway/adaptive.py) beside the fixed K grid, on a mixed workload (every other request
sampled at temperature 1) and near-zero acceptance (a cluster per profile, a gateway per mode on its one target and
draft: tandem/bench.py add_gateway; the adaptive rows cap k at the largest of --ks and give the mean k it chose):

    tandem bench speed --speculation fixed,adaptive --ks 0,1,2,3 --workload mixed
    tandem bench speed --speculation fixed,adaptive --synthetic-acceptance 0.92,0.72,0.36 --synthetic-acceptance 0.02

Two micro-batches alternating (issue 14, item 4): a /halves mode runs on two gateways, request i sent to gateway
i mod 2, so the target verifies one half of the batch while the draft proposes for the other
(tandem/bench_served.py); beside the same mode on one gateway:

    tandem bench speed --speculation fixed,fixed/halves --ks 0,3 --batches 32

Requests sent as token ids (request i seeded SEED_BASE + i, tandem/bench.py, in process too: a synthetic profile's
draws are then the same on both sides), ignore_eos, greedy unless --workload mixed. Clients: `batch` threads, each
sending its next request when its last one answers (--clients closed, the default), or every request at once to a
gateway that runs at most `batch` a round (--clients queued: each batch size its own gateway with --max-batch, a
server at capacity: a finished request's slot goes to a waiting one). Unknown flags go to `tandem serve`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import grpc

from tandem.bench import add_gateway, bench_prompts, start_cluster, stop_cluster, write_results
from tandem.bench_served import run_served
from tandem.bench_speed_report import expected_lengths, plot, table
from tandem.v1 import generate_pb2_grpc

VARIANTS = {"serial": ["--no-overlap-rounds"], "no-ahead": ["--no-propose-ahead"], "no-busy-poll": ["--no-busy-poll"],
            "no-mixed": ["--no-mixed-prefill"], "no-join": ["--no-join-ahead"], "late": ["--late-admission"],
            "accept-first": ["--no-early-propose"], "halves": []}


def mode_args(mode: str) -> list[str]:
    """The gateway flags of a --speculation mode: fixed | adaptive, then any of /serial, /no-ahead, /no-busy-poll,
    /no-mixed, /no-join, /late, /accept-first and /halves (no flag: two gateways, tandem/bench_served.py)."""
    base, *variants = mode.split("/")
    if base not in ("fixed", "adaptive") or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--speculation: fixed or adaptive, each optionally followed by any of /{', /'.join(VARIANTS)}; "
                         f"got {mode!r}")
    return ["--speculation", base] + [f for v in variants for f in VARIANTS[v]]


def gateways(mode: str) -> int:
    """Gateways a mode runs on the one target and draft: two for /halves (each gets every other request)."""
    return 2 if "halves" in mode.split("/")[1:] else 1


def parse(argv):
    p = argparse.ArgumentParser(prog="tandem bench speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--random-config", default="", help="a random-weight preset (models/presets.py) instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the --random-config weights")
    p.add_argument("--device", default="cpu", help="cpu | cuda (target cuda:0, draft cuda:1 if present)")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--synthetic-acceptance", action="append", default=[], help="BENCHMARK ONLY, changes the "
                   "output: the target accepts each draft with probability P, or P1,P2,... per position, after its "
                   "real forward (greedy). Repeat for several profiles. Makes speedup measurable on random weights")
    p.add_argument("--gateway", default=None, help="use a running gateway's gRPC address (HOST:PORT of its "
                   "--grpc-port, 50051 by default) instead of starting one")
    p.add_argument("--metrics", default=None, help="with --gateway: its HTTP HOST:PORT (/metrics) for the split")
    p.add_argument("--ks", default="0,1,2,3,4")
    p.add_argument("--speculation", default="fixed", help="fixed (the --ks grid), adaptive (k <= the largest of "
                   "--ks chosen per request and round), or fixed,adaptive: both, a gateway each on one target and "
                   "draft; /serial after a mode runs its gateway with --no-overlap-rounds (e.g. fixed,fixed/serial), "
                   "/no-ahead with --no-propose-ahead, /no-busy-poll with --no-busy-poll, /no-mixed with "
                   "--no-mixed-prefill, /no-join with --no-join-ahead, /late with --late-admission, /accept-first with --no-early-propose; /halves runs "
                   "the mode on two gateways, each with half the clients, so the services alternate between two "
                   "micro-batches "
                   "(e.g. fixed/no-busy-poll,fixed/halves/no-busy-poll)")
    p.add_argument("--workload", default="greedy", choices=["greedy", "mixed"], help="mixed: every other request "
                   "at temperature 1 (the synthetic acceptance applies to greedy ones only)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--requests-per-batch", type=int, default=2, help="requests = this x batch size")
    p.add_argument("--clients", default="closed", choices=["closed", "queued"], help="closed: batch clients, each "
                   "sending its next request when one answers; queued: every request at once, the gateway (one a "
                   "batch size, --max-batch) running batch of them a round")
    p.add_argument("--repeats", type=int, default=1, help="measure each row this many times (interleaved; the "
                   "--in-process rows too); the table gives the mean and the spread (max - min) / mean")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--in-process", action="store_true", help="also run the grid in one process, no gRPC")
    p.add_argument("--quantization", default="auto", help="auto | none | fp8 (tandem serve --help)")
    p.add_argument("--draft-quantization", default="", help="the draft's (default: --quantization)")
    p.add_argument("--out", default="results/speed")
    return p.parse_known_args(argv)


def run_profile(model: str, rid: str | None, a, extra: list[str], profile: str) -> list[dict]:
    """The served grid with one synthetic acceptance profile ('' : the model's own): one target and draft with a
    gateway per mode, all up at once, measured in turn (each batch's rows --repeats times, interleaved, the modes' order reversed every other
    repeat: load drifts alike for all); in process (--in-process) between the served repeats on a CPU, else after."""
    ks = [int(x) for x in a.ks.split(",")]
    modes = a.speculation.split(",")
    serve_args = ["--device", a.device, "--quantization", a.quantization] + (["--dtype", a.dtype] if a.dtype else [])
    serve_args += ["--draft-quantization", a.draft_quantization] if a.draft_quantization else []
    if a.random_config:
        serve_args += ["--random-config", a.random_config, "--seed", str(a.seed)]
    if profile:
        serve_args += ["--synthetic-acceptance", profile]
    batches = [int(x) for x in a.batches.split(",")]
    if a.clients == "queued" and a.gateway:
        raise SystemExit("tandem bench speed: --clients queued starts a gateway per batch size (--max-batch), so "
                         "not with --gateway")
    if a.gateway:
        from tandem.bench import check_gateway
        check_gateway(a.gateway)
    if a.gateway and any(gateways(m) > 1 for m in modes):
        raise SystemExit("tandem bench speed: a /halves mode starts its own two gateways, so not with --gateway")
    per_batch = a.clients == "queued"               # a gateway per (mode, batch size), --max-batch it
    clusters = {}                   # (mode, batch or None) -> its gateways: [(process or None, gRPC, metrics address)]
    runs, inproc = {}, {}                           # (mode, batch, k) -> served runs; (batch, k) -> in-process runs
    engines = None
    if a.in_process and a.device == "cpu":          # CPU: in process between the served repeats (drift alike)
        from tandem.bench_inprocess import grid_engines, measure
        engines = grid_engines(model, a, profile)
    try:
        start_gateways(clusters, a, modes, batches if per_batch else [None], None if rid else model, max(ks),
                       serve_args + extra)
        stubs = {m: [generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(g[1])) for g in c]
                 for m, c in clusters.items()}
        for b in batches:
            prompts = bench_prompts(model, b * a.requests_per_batch, a.prompt_tokens, seed=b)
            for rep in range(a.repeats):
                for mode in (modes if rep % 2 == 0 else modes[::-1]):      # each mode first every other repeat
                    for k in (ks if mode.startswith("fixed") else [max(ks)]):
                        key = (mode, b if per_batch else None)
                        r = run_served(stubs[key], [g[2] for g in clusters[key]], prompts, k, b, a.max_tokens,
                                       a.workload == "mixed", len(prompts) if a.clients == "queued" else 0)
                        r.update(acceptance=profile or "model", speculation=mode, workload=a.workload,
                                 clients=a.clients)
                        runs.setdefault((mode, b, k), []).append(r)
                        print(f"served {r['acceptance']} batch {b:3d} {mode} K={k}: {r['tokens_per_s']:9.1f} tok/s  MAL "
                              f"{r['mean_acceptance_length']:.2f}  mean k {r['mean_k']:.2f}  ms/round "
                              f"{r['ms_per_round'].get('round', 0):.2f}  prefills in a Verify "
                              f"{r['prefills_in_verify']} (joins with the push {r['joins_with_ahead']}, admitted late "
                              f"{r['late_admissions']})", flush=True)
                if engines is not None:
                    for k in ks:
                        inproc.setdefault((b, k), []).append(measure(*engines, prompts, k, b, a.max_tokens))
    finally:
        for proc, _, _ in reversed([g for c in clusters.values() for g in c]):   # added gateways, then the cluster
            stop_cluster(proc)
    rows = []
    for rs in runs.values():                        # the mean of the repeats (tokens/s and the split), and their spread
        tps = [r["tokens_per_s"] for r in rs]
        rows.append({**rs[-1], "tokens_per_s": sum(tps) / len(tps), "tokens_per_s_runs": tps, "ms_per_round": mean_split(rs),
                     "spread": (max(tps) - min(tps)) / (sum(tps) / len(tps))})
    for b in {r["batch"] for r in rows}:             # against its own mode's K = 0 row (adaptive: the first mode's)
        first = next(r["tokens_per_s"] for r in rows if r["batch"] == b)
        for r in (r for r in rows if r["batch"] == b):
            r["speedup"] = r["tokens_per_s"] / next((x["tokens_per_s"] for x in rows if x["batch"] == b and x["k"] ==
                                                     ks[0] and x["speculation"] == r["speculation"]), first)
    if a.in_process:
        from tandem.bench_inprocess import run_grid
        if engines is None:                         # GPU: after the served grid (the clusters hold the memory)
            for r in run_grid(model, a, profile):
                inproc.setdefault((r["batch"], r["k"]), []).append(r)
        inproc = {key: {**rs[-1], "tokens_per_s": statistics.mean(x["tokens_per_s"] for x in rs),
                        "ms_per_round": mean_split(rs)} for key, rs in inproc.items()}
        for r in (r for r in rows if r["speculation"].startswith("fixed")):
            ip = inproc[(r["batch"], r["k"])]
            base = inproc[(r["batch"], ks[0])]["tokens_per_s"]
            r.update(inprocess_tokens_per_s=ip["tokens_per_s"], inprocess_speedup=ip["tokens_per_s"] / base,
                     served_over_inprocess=r["tokens_per_s"] / ip["tokens_per_s"],
                     inprocess_ms_per_round=ip["ms_per_round"],
                     inprocess_mean_acceptance_length=ip["mean_acceptance_length"])
    return rows


def start_gateways(clusters: dict, a, modes: list[str], batches: list, model: str | None, kmax: int,
                   args: list[str]) -> None:
    """One target and draft (or a.gateway); gateways(mode) gateways per mode and batch (None: one for all batches,
    else --max-batch it), into `clusters` as they start (the caller stops them)."""
    for mode in modes:
        for b in batches:
            cap = ["--max-batch", str(max(1, b // gateways(mode))), "--max-waiting", str(b * a.requests_per_batch)] if b else []
            clusters[mode, b] = [(None, a.gateway, a.metrics)] if a.gateway else []
            while len(clusters[mode, b]) < gateways(mode):
                first = next((c[0][0] for c in clusters.values() if c), None)
                how = start_cluster if first is None else partial(add_gateway, first)
                clusters[mode, b].append(how(model, kmax, args + mode_args(mode) + cap))


def mean_split(rs: list[dict]) -> dict[str, float]:
    """The repeats' round split, phase by phase (a phase some repeats lack: the mean of those that have it)."""
    phases = {ph for r in rs for ph in r["ms_per_round"]}
    return {ph: statistics.mean(r["ms_per_round"][ph] for r in rs if ph in r["ms_per_round"]) for ph in phases}


def add_roofline(rows: list[dict], model: str, a) -> float:
    """Each row's ideal round, ideal tokens/s and the fraction served reaches -> the bandwidth used."""
    import torch

    from services.config import DTYPES
    from tandem.bench_floor import copy_bandwidth
    from tandem.roofline import round_floor_ms
    device = "cuda:0" if a.device == "cuda" else a.device
    bw = copy_bandwidth(device, (2048 if device.startswith("cuda") else 64) << 20)
    dtype = DTYPES[a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    context = a.prompt_tokens + a.max_tokens // 2                       # mean cached positions while decoding
    for r in rows:            # adaptive rows: the floor at the nearest whole k to the mean they drafted
        k = round(r["mean_k"]) if r.get("speculation", "").startswith("adaptive") else r["k"]
        r.update(round_floor_ms(model, dtype, r["batch"], k, context, bw, a.quantization, a.draft_quantization,
                                device))
        r["ideal_tokens_per_s"] = r["batch"] * r["mean_acceptance_length"] / (r["ideal_round_ms"] / 1000)
        r["of_ideal"] = r["tokens_per_s"] / r["ideal_tokens_per_s"]
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return bw


def main(argv=None) -> int:
    from tandem.bench_inprocess import random_id
    from models.tiny import default_model
    a, extra = parse(argv)
    rid = random_id(a)
    model = rid or str(a.model or default_model())
    profiles = a.synthetic_acceptance or [""]
    if any(profiles):
        print(f"WARNING: BENCHMARK ONLY --synthetic-acceptance {' / '.join(profiles)}: drafts are accepted at "
              "random after the real forward pass; outputs are not the model's", file=sys.stderr, flush=True)
    rows = [r for profile in profiles for r in run_profile(model, rid, a, extra, profile)]
    bw = add_roofline(rows, model, a)
    synth = (f"; WARNING: BENCHMARK ONLY synthetic acceptance {' / '.join(profiles)} (drafts accepted at random "
             f"after the real forward; outputs are not the model's; {expected_lengths(profiles, a.ks)})"
             if any(profiles) else "")
    load = "greedy" if a.workload == "greedy" else "mixed (every other request T=1)"
    md = (f"Speed of {model} on {a.device} ({time.strftime('%Y-%m-%d')}), {load}, {a.prompt_tokens}-token prompts, "
          f"{a.max_tokens} new tokens, {a.requests_per_batch} x batch requests "
          f"{'sent at once, at most batch a round (--max-batch)' if a.clients == 'queued' else 'from batch clients'} "
          f"after one warm-up batch (and every prompt once for 2 tokens){synth}\n"
          f"`tandem bench speed {' '.join(argv or [])}`\n\n" + table(rows) + "\n\n"
          "ms per round: propose / verify are the RPC walls seen by the gateway; transfer and draft compute are "
          "inside propose, target compute inside verify; RPC overhead = propose + verify less those, of which the "
          "hops (request / response: one-way, both calls, from the services' stamps) and the handlers' time around "
          "their timed work (service); gateway = "
          "round less both RPCs. Ideal round: byte floors of the verify step and of K draft steps (tandem/roofline.py) "
          f"at {a.prompt_tokens + a.max_tokens // 2} cached positions and {bw / 1e12:.2f} TB/s (copy bandwidth measured "
          "in this run); ideal tok/s = batch x mean acceptance length / ideal round.\n")
    write_results(a.out, "speed", md, rows, lambda path: plot(rows, path))
    return 0
