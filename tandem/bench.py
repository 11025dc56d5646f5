"""`tandem bench acceptance`: draft acceptance of the served cluster on held-out text; the dispatcher
of every `tandem bench` (speed: tandem/bench_speed.py, bridge: bench_bridge.py, floor: bench_floor.py,
dsa: bench_dsa.py, overlap: bench_overlap.py,
profile: bench_profile.py, fp8: bench_fp8.py, fp8-sweep: bench_fp8_sweep.py, steps: bench_steps.py,
heldout: bench_heldout.py, nextline: bench_nextline.py, prefill: bench_prefill.py,
prefill-speed: bench_prefill_speed.py, rows: bench_rows.py).

Starts `tandem serve` (or uses --gateway ADDR), sends held-out code prompts with greedy and
temperature-1 decoding at K = 1..max, and reports vLLM's metrics: mean acceptance length
(1 + accepted / drafts), per-position acceptance (accepted at position i / drafts) and tokens per
target forward (completion tokens / (1 prefill + rounds)). Writes a markdown table and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from tandem.v1 import generate_pb2, generate_pb2_grpc

# a bench's request i is seeded SEED_BASE + i, served and in process alike: --synthetic-acceptance draws from
# each request's seeded generator, so both sides then see the same acceptance lengths
SEED_BASE = 1000


def heldout_prompts(model: Path, n: int, prompt_chars: int, seed: int, end_at_line: bool = True) -> list[str]:
    """Prompts cut from the held-out files the model card names (else the stdlib's own files): each starts at
    a line and ends after a line break (end_at_line: how code-completion prompts end), else after exactly
    prompt_chars characters."""
    root = Path(os.__file__).parent
    listed = model / "heldout_files.json"
    names = json.loads(listed.read_text())["files"] if listed.exists() else []
    files = [root / p for p in names if (root / p).exists()]
    if not files:
        print(f"note: no held-out file list at {listed} (or none of its files here); using stdlib files",
              file=sys.stderr)
        files = sorted(root.glob("*.py"))[-20:]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = rng.choice(files).read_text(errors="ignore")
        if len(text) > prompt_chars * 2:
            start = rng.randrange(0, len(text) - prompt_chars)
            start = text.rfind("\n", 0, start) + 1           # start at a line
            end = start + prompt_chars
            end = text.rfind("\n", start, end) + 1 if end_at_line else end
            if end > start:
                out.append(text[start:end])
    return out


def run_acceptance(stub, prompts: list[str], ks: list[int], temperature: float, max_tokens: int,
                   concurrency: int) -> list[dict]:
    rows = []
    for k in ks:
        def one(i_p):
            i, p = i_p
            req = generate_pb2.GenerateRequest(text=p, max_tokens=max_tokens, temperature=temperature,
                                               seed=SEED_BASE + i, ignore_eos=True, num_speculative_tokens=k)
            return stub.Generate(req, timeout=600)
        with ThreadPoolExecutor(concurrency) as pool:
            resps = list(pool.map(one, enumerate(prompts)))
        drafts = sum(r.spec_stats.num_drafts for r in resps)
        accepted = sum(r.spec_stats.num_accepted_tokens for r in resps)
        per_pos = [sum(r.spec_stats.accepted_per_position[i] for r in resps
                       if len(r.spec_stats.accepted_per_position) > i) / max(drafts, 1) for i in range(k)]
        tokens = sum(r.usage.completion_tokens for r in resps)
        forwards = sum(1 + r.spec_stats.num_drafts for r in resps)
        rows.append({"k": k, "temperature": temperature, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                     "per_position": per_pos, "tokens_per_forward": tokens / forwards,
                     "drafts": drafts, "accepted": accepted, "requests": len(resps)})
    return rows


def table(rows: list[dict]) -> str:
    kmax = max(r["k"] for r in rows)
    head = ("| decoding | K | mean acceptance length | tokens / target forward | "
            + " | ".join(f"pos {i + 1}" for i in range(kmax)) + " |")
    sep = "|" + "---|" * (4 + kmax)
    lines = [head, sep]
    for r in rows:
        pos = [f"{p:.3f}" for p in r["per_position"]] + [""] * (kmax - r["k"])
        mode = "greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}"
        lines.append(f"| {mode} | {r['k']} | {r['mean_acceptance_length']:.3f} | {r['tokens_per_forward']:.3f} | "
                     + " | ".join(pos) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, temp in zip(axes, sorted({r["temperature"] for r in rows})):
        for r in (r for r in rows if r["temperature"] == temp):
            ax.plot(range(1, r["k"] + 1), r["per_position"], marker="o", label=f"K={r['k']}")
        ax.set_title("greedy" if temp == 0 else f"temperature {temp:g}")
        ax.set_xlabel("draft position")
        ax.set_xticks(range(1, max(r["k"] for r in rows) + 1))
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("acceptance rate (accepted / drafts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_results(out: str | Path, name: str, md: str | None, data, plot_fn=None) -> None:
    """One benchmark's outputs under `out`: name.md (also printed), name.json, and name.png by plot_fn(path)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    written = [out / f"{name}.json"]
    if md is not None:
        (out / f"{name}.md").write_text(md)
        written.insert(0, out / f"{name}.md")
        print(md)
    if plot_fn is not None:
        plot_fn(out / f"{name}.png")
        written.append(out / f"{name}.png")
    print("wrote " + ", ".join(str(p) for p in written))


def serve_argv(model: str | None, kmax: int, ports: list[int], extra: list[str]) -> list[str]:
    # `tandem serve`'s arguments for a cluster on `ports` (gateway gRPC, target, draft, bridge, dist, gateway HTTP)
    return [*(["--model", model] if model else []), "-k", str(kmax), "--grpc-port", str(ports[0]), "--target-port",
            str(ports[1]), "--draft-port", str(ports[2]), "--bridge-port", str(ports[3]), "--dist-port", str(ports[4]),
            "--http-port", str(ports[5]), *extra]


def start_cluster(model: str | None, kmax: int, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    """`tandem serve` on free ports -> (process, gateway gRPC address, gateway HTTP address).
    model None: `extra` names the model (--random-config NAME)."""
    from infra.ports import free_ports
    ports = free_ports(6)                      # distinct, and outside the range the OS hands out on port 0
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", *serve_argv(model, kmax, ports, extra)],
                            stdout=subprocess.PIPE, text=True)
    proc.ports = ports
    for line in proc.stdout:                   # "tandem: serving ..." means all three are SERVING
        print(line, end="", flush=True)
        if line.startswith("tandem: serving"):
            return proc, f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[5]}"
    raise SystemExit(f"tandem serve exited with code {proc.wait()}")


def add_gateway(cluster: subprocess.Popen, model: str | None, kmax: int,
                extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    """One more gateway on `cluster`'s target and draft (a start_cluster process), as `tandem serve` with `extra`
    would start it, on free ports -> (process, gRPC address, HTTP address). Modes that differ only in gateway flags
    (--speculation, --no-overlap-rounds) so share one target and draft: their rows differ by the gateway alone,
    not by two sets of service processes, and the GPU holds one model."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from infra.ports import free_ports
    from tandem.serve import commands, parse as serve_parse
    cmd = next(c for name, c, _ in commands(serve_parse(serve_argv(model, kmax, cluster.ports, extra)))
               if name == "gateway")
    grpc_port, http_port = free_ports(2)
    for flag, port in (("--grpc-port", grpc_port), ("--http-port", http_port)):
        cmd[cmd.index(flag) + 1] = str(port)
    proc = subprocess.Popen(cmd)
    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}")).Check
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                print(f"tandem bench: added a gateway on 127.0.0.1:{grpc_port} to the target and draft on ports "
                      f"{cluster.ports[1]}, {cluster.ports[2]}", flush=True)
                return proc, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
        except grpc.RpcError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the added gateway ({' '.join(cmd)}) did not serve (exit code {proc.wait()})")


def check_gateway(addr: str, flag: str = "--gateway") -> str:
    """`addr` if a gateway's gRPC API answers there, else exit naming the flag (the HTTP port is the usual slip)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
            return addr
        except grpc.RpcError as e:
            raise SystemExit(f"tandem bench: {flag} {addr}: no gateway gRPC API answers there ({e.code().name}: "
                             f"{e.details()}); give its gRPC address (--grpc-port, 50051 by default), not the "
                             "HTTP port") from None


def stop_cluster(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def acceptance(argv) -> int:
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem bench acceptance", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--gateway", default=None, help="use a running gateway's gRPC address (HOST:PORT of its "
                   "--grpc-port, 50051 by default) instead of starting one (one "
                   "started with --speculation fixed: an adaptive gateway drafts its own k, not the table's K)")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=600, help="at most this long, cut after a line break")
    p.add_argument("--mid-line", action="store_true", help="cut prompts at exactly --prompt-chars instead")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/acceptance")
    a, extra = p.parse_known_args(argv)
    model = str(a.model or default_model())
    proc = None
    if a.gateway is None:   # the model's acceptance at each K: every round drafts K (adaptive would pick its own k)
        fixed = [] if any(x.split("=")[0] == "--speculation" for x in extra) else ["--speculation", "fixed"]
        proc, a.gateway, _ = start_cluster(model, a.max_k, fixed + extra)
    else:
        check_gateway(a.gateway)
    try:
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(a.gateway))
        prompts = heldout_prompts(Path(model), a.prompts, a.prompt_chars, a.seed, end_at_line=not a.mid_line)
        started = time.time()
        rows = []
        for t in (float(x) for x in a.temperatures.split(",")):
            rows += run_acceptance(stub, prompts, list(range(1, a.max_k + 1)), t, a.max_tokens, a.concurrency)
    finally:
        stop_cluster(proc)
    md = (f"Acceptance of {model} on {a.prompts} held-out prompts (up to {a.prompt_chars} chars, "
          f"{'cut mid-line' if a.mid_line else 'ending in a line break'}), "
          f"{a.max_tokens} new tokens each, {time.time() - started:.0f} s\n\n" + table(rows) + "\n")
    write_results(a.out, "acceptance", md, rows, lambda path: plot(rows, path))
    return 0


BENCHES = {"acceptance": "tandem.bench:acceptance", "speed": "tandem.bench_speed:main",
           "inprocess": "tandem.bench_inprocess:main", "bridge": "tandem.bench_bridge:main",
           "attention": "tandem.bench_attention:main",
           "floor": "tandem.bench_floor:main", "dsa": "tandem.bench_dsa:main",
           "overlap": "tandem.bench_overlap:main", "profile": "tandem.bench_profile:main",
           "fp8": "tandem.bench_fp8:main", "fp8-sweep": "tandem.bench_fp8_sweep:main",
           "steps": "tandem.bench_steps:main",
           "heldout": "tandem.bench_heldout:main", "nextline": "tandem.bench_nextline:main",
           "prefill": "tandem.bench_prefill:main", "prefill-speed": "tandem.bench_prefill_speed:main",
           "rows": "tandem.bench_rows:main", "gateway": "tandem.bench_gateway:main"}


def main(argv=None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        import importlib
        lines = [f"usage: tandem bench {{{','.join(BENCHES)}}} [options]", "", "benchmarks (BENCHMARKS.md; "
                 "`tandem bench NAME --help` for one's options):"]
        for name, target in BENCHES.items():
            module = importlib.import_module(target.split(":")[0])
            text = " ".join((module.__doc__ or "").split()).split(": ", 1)[-1]
            first = re.split(r"(?<=[.;])\s", text)[0].rstrip(".;")
            lines.append(f"  {name:13s} {first}")
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import importlib
    module, fn = BENCHES[argv[0]].split(":")
    return getattr(importlib.import_module(module), fn)(argv[1:])


def bench_prompts(model: str, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """n prompts as token ids: uniform random ids for a random model id (`random:NAME:seed=S`),
    else held-out text cut to about prompt_tokens tokens by the checkpoint's tokenizer."""
    from models.presets import model_config, parse_random_id
    if parse_random_id(model) is not None:
        vocab = model_config(model).vocab_size
        rng = random.Random(seed)
        return [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(n)]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return [tok.encode(t).ids[:prompt_tokens] for t in heldout_prompts(Path(model), n, prompt_tokens * 6, seed,
                                                                      end_at_line=False)]
