"""`tandem bench prefill`: inter-token latency of running streams while a long prompt arrives, with and
without chunked prefill (gateway/chunking.py): a `tandem serve` cluster per --max-num-batched-tokens value.

Each repeat starts --streams greedy streams (ignore_eos, K drafts), waits until every one has streamed a few
responses, then sends one --long-tokens prompt (fresh random ids: no prefix hit) and records its time to first
token. ITL: the gaps between consecutive streamed responses of the running streams (one response per round:
up to K + 1 tokens, as vLLM's benchmark counts a chunk) that overlap the time from the long prompt's send to
its first token, p50 / p99 per repeat; the table gives the median over repeats and the spread (min-max).

    tandem bench prefill --streams 4 --long-tokens 1500 --budgets 0,256 --repeats 3
    tandem bench prefill --device cuda --random-config v2-lite --streams 16 --long-tokens 8192 --budgets 0,2048
With --ttft-tokens N, each cluster (idle, after the warm-up, before the repeats) also times the first token of a fresh N-token prompt
(cold) and then of the same prompt with another last token, whose other full blocks the prefix cache holds (hit),
--repeats pairs, medians in a second table.

    tandem bench prefill --device cuda --random-config v2-lite-yarn --max-model-len 16384 --num-blocks 6144 \
        --streams 16 --long-tokens 8192 --budgets 0,2048 --ttft-tokens 8192
Unknown flags go to `tandem serve`.
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import grpc

from infra.help import DefaultsHelp
from tandem.bench import start_cluster, stop_cluster, write_results
from tandem.v1 import generate_pb2, generate_pb2_grpc


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def one_repeat(stub, vocab: int, streams: int, long_tokens: int, k: int, seed: int) -> dict:
    """Streams running, one long prompt -> {"itl_p50_ms", "itl_p99_ms", "ttft_s", "gaps"}."""
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in range(streams)]
    calls = []

    def run(i: int) -> None:
        call = stub.GenerateStream(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[rng.randrange(3, vocab) for _ in range(16)]), max_tokens=1800,
            ignore_eos=True, num_speculative_tokens=k), timeout=900)
        calls.append(call)
        try:
            for _ in call:
                times[i].append(time.perf_counter())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 5:                 # every stream is decoding
        time.sleep(0.01)
    long = [rng.randrange(3, vocab) for _ in range(long_tokens)]
    sent = time.perf_counter()
    first = next(iter(stub.GenerateStream(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=long), max_tokens=1, ignore_eos=True, num_speculative_tokens=k),
        timeout=900)))
    got = time.perf_counter()
    assert first.token_ids or first.text is not None
    end = time.monotonic() + 60
    while min(t[-1] for t in times) <= got and time.monotonic() < end:     # each stream's gap across it ends
        time.sleep(0.01)
    for c in calls:
        c.cancel()
    for t in threads:
        t.join(timeout=60)
    gaps = [1e3 * (b - a) for ts in times for a, b in zip(ts, ts[1:]) if b >= sent and a <= got]   # overlap the prefill
    return {"itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99), "ttft_s": got - sent, "gaps": len(gaps)}


def first_token_s(stub, ids: list[int], k: int) -> float:
    sent = time.perf_counter()
    first = next(iter(stub.GenerateStream(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids), max_tokens=1, ignore_eos=True, num_speculative_tokens=k),
        timeout=900)))
    assert first.token_ids or first.text is not None
    return time.perf_counter() - sent


def prefix_ttft(stub, vocab: int, tokens: int, k: int, seed: int) -> dict:
    """Time to first token of a fresh prompt (cold), then of it with a new last token (its full blocks cached)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(tokens)]
    cold = first_token_s(stub, prompt, k)
    hit = first_token_s(stub, prompt[:-1] + [3 + (prompt[-1] - 2) % (vocab - 3)], k)
    return {"cold_s": cold, "hit_s": hit}


def main(argv) -> int:
    from models.presets import model_config
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem bench prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelp)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled test model)")
    p.add_argument("--streams", type=int, default=4, help="running streams")
    p.add_argument("--long-tokens", type=int, default=1500, help="the arriving prompt's length")
    p.add_argument("--budgets", default="0,256", help="--max-num-batched-tokens values, a cluster each")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("-k", type=int, default=3, help="drafts per round of the streams")
    p.add_argument("--ttft-tokens", type=int, default=0, help="also time a prompt of this length cold and on a "
                   "prefix hit (0: not)")
    p.add_argument("--out", default="bench-out")
    a, extra = p.parse_known_args(argv)
    random_model = "--random-config" in extra
    model = None if random_model else str(a.model or default_model())
    rows = []
    for budget in [int(b) for b in a.budgets.split(",")]:
        proc = None
        try:
            proc, addr, _ = start_cluster(model, a.k, extra + ["--max-num-batched-tokens", str(budget)])
            ch = grpc.insecure_channel(addr)
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            vocab = model_config(model or f"random:{extra[extra.index('--random-config') + 1]}:seed=0").vocab_size
            one_repeat(stub, vocab, a.streams, a.long_tokens // 4, a.k, seed=0)      # warm-up
            pairs = [prefix_ttft(stub, vocab, a.ttft_tokens, a.k, seed=100 + i)
                     for i in range(a.repeats if a.ttft_tokens else 0)]
            runs = [one_repeat(stub, vocab, a.streams, a.long_tokens, a.k, seed=1 + i) for i in range(a.repeats)]
            ch.close()
        finally:
            stop_cluster(proc)
        med = {key: statistics.median(r[key] for r in runs) for key in ("itl_p50_ms", "itl_p99_ms", "ttft_s")}
        med.update({key: statistics.median(r[key] for r in pairs) for key in ("cold_s", "hit_s") if pairs})
        rows.append({"budget": budget, **med, "runs": runs, "prefix_ttft": pairs})
        write_results(a.out, "prefill", report(a, rows), rows)                 # after each cluster
    return 0


def report(a, rows: list[dict]) -> str:
    lines = [f"ITL of {a.streams} running streams (K = {a.k}) while a {a.long_tokens}-token prompt arrives "
             f"(median of {a.repeats} repeats, min-max in brackets)", "",
             "| --max-num-batched-tokens | ITL p50 ms | ITL p99 ms | long prompt TTFT s | gaps / repeat |",
             "|---|---|---|---|---|"]
    for r in rows:
        span = {key: f"{min(x[key] for x in r['runs']):.{d}f}-{max(x[key] for x in r['runs']):.{d}f}"
                for key, d in (("itl_p50_ms", 0), ("itl_p99_ms", 0), ("ttft_s", 2))}
        lines.append(f"| {r['budget'] or '0 (whole)'} | {r['itl_p50_ms']:.0f} ({span['itl_p50_ms']}) | "
                     f"{r['itl_p99_ms']:.0f} ({span['itl_p99_ms']}) | {r['ttft_s']:.2f} ({span['ttft_s']}) | "
                     f"{statistics.median(x['gaps'] for x in r['runs']):.0f} |")
    if a.ttft_tokens:
        lines += ["", f"Time to first token of a {a.ttft_tokens}-token prompt, idle cluster (median of {a.repeats}): "
                  "fresh (cold), then the same with another last token (prefix hit)", "",
                  "| --max-num-batched-tokens | cold s | prefix hit s | hit / cold |", "|---|---|---|---|"]
        lines += [f"| {r['budget'] or '0 (whole)'} | {r['cold_s']:.3f} | {r['hit_s']:.3f} | "
                  f"{r['hit_s'] / r['cold_s']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"
