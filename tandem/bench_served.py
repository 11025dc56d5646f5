"""One measured run of `tandem bench speed` against served gateways: closed-loop (or queued) clients, tokens/s and
the round split read from each gateway's /metrics before and after.

Several gateways on one target and draft (a /halves mode, tandem/bench_speed.py): request i goes to gateway
i mod n, so each runs its own rounds over a part of the batch and the services alternate between them (the target
verifies one part while the draft proposes for the other). The split is then per round of one gateway, summed
over all of them.
"""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tandem.bench import SEED_BASE
from tandem.v1 import generate_pb2

METRIC = "tandem:round_phase_seconds"
CHOSEN_K = "tandem:spec_decode_chosen_k"
REPROBES = "tandem:spec_decode_reprobes_total"
COUNTERS = {REPROBES: "reprobes", "tandem:num_prefills_in_verify_total": "prefills_in_verify",
            "tandem:spec_decode_joins_with_ahead_total": "joins_with_ahead",
            "tandem:num_late_admissions_total": "late_admissions"}
PHASES = ("round", "propose", "transfer", "draft_compute", "verify", "target_compute", "gateway")


def scrape(http_addr: str) -> dict[str, list[float]]:
    """The gateway's round split so far: phase -> [sum of seconds, rounds]."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://{http_addr}/metrics", timeout=10).read().decode()
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (METRIC + "_sum", METRIC + "_count"):
                out.setdefault(s.labels["phase"], [0.0, 0.0])[s.name.endswith("_count")] += s.value
            elif s.name in (CHOSEN_K + "_sum", CHOSEN_K + "_count"):     # k a request got a round, summed
                out.setdefault("chosen_k", [0.0, 0.0])[s.name.endswith("_count")] += s.value
            elif s.name in COUNTERS:                                     # the counters a row reports
                out[COUNTERS[s.name]] = [s.value, 0.0]
    return out


def scrape_all(addrs: list[str | None]) -> list[dict[str, list[float]]]:
    return [scrape(a) if a else {} for a in addrs]


def delta(before: list[dict], after: list[dict], name: str, i: int = 0) -> float:
    """after - before of one metric's sum (i = 0) or count (i = 1), over all gateways."""
    return sum(a.get(name, [0, 0])[i] - b.get(name, [0, 0])[i] for b, a in zip(before, after))


def run_served(stubs: list, http_addrs: list[str | None], prompts: list[list[int]], k: int, batch: int,
               max_tokens: int, mixed: bool = False, clients: int = 0) -> dict:
    """`batch` concurrent requests at a time until every prompt is done (after one warm-up batch, and every
    other prompt once at this k for 2 tokens); greedy, or (mixed) every other one sampled at temperature 1.
    The short pass puts every prompt in both services' prefix caches before each row, so every row decodes with
    warm caches (before k = 0 prompts were fed to the draft, a K > 0 row after a K = 0 row found their prefixes
    on the target alone and waited on a recovery each: gateway/prefix_recovery.py). clients > batch: that many
    threads (a gateway started with --max-batch batch queues the rest). Request i goes to gateway i mod n."""
    n = len(stubs)

    def one(i_ids, tokens=max_tokens):
        i, ids = i_ids
        t0 = time.perf_counter()
        r = stubs[i % n].Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=ids), max_tokens=tokens, ignore_eos=True, seed=SEED_BASE + i,
            temperature=1.0 if mixed and i % 2 else 0.0, num_speculative_tokens=k), timeout=900)
        return r, time.perf_counter() - t0
    with ThreadPoolExecutor(max(batch, clients)) as pool:
        list(pool.map(one, enumerate(prompts[:batch])))                    # warm-up
        list(pool.map(partial(one, tokens=2), enumerate(prompts[batch:])))  # prefix caches
        before = scrape_all(http_addrs)
        t0 = time.perf_counter()
        results = list(pool.map(one, enumerate(prompts)))
        wall = time.perf_counter() - t0
        after = scrape_all(http_addrs)
    tokens = sum(r.usage.completion_tokens for r, _ in results)
    drafts = sum(r.spec_stats.num_drafts for r, _ in results)
    accepted = sum(r.spec_stats.num_accepted_tokens for r, _ in results)
    by_gateway = [int(a.get("round", [0, 0])[1] - b.get("round", [0, 0])[1]) for b, a in zip(before, after)]
    rounds = sum(by_gateway)
    split = {ph: 1000 * delta(before, after, ph) / rounds for ph in PHASES} if rounds else {}
    if rounds:          # the wall between one gateway's rounds (prefill, re-sync, a request's turnover), per round
        split["between"] = 1000 * n * wall / rounds - split["round"]
        for ph in ("prefill", "resync"):
            split[ph] = 1000 * delta(before, after, ph) / rounds
        for ph in ("rpc_request", "rpc_response", "rpc_service"):   # per round that had them (this host)
            if d := delta(before, after, ph, 1):
                split[ph] = 1000 * delta(before, after, ph) / d
    chosen = delta(before, after, "chosen_k"), delta(before, after, "chosen_k", 1)
    return {"k": k, "batch": batch, "mean_k": chosen[0] / chosen[1] if chosen[1] else float(k), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "gateways": n, "rounds_by_gateway": by_gateway,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0, "rounds": rounds,
            # the rounds' batch slots that held a decoding request (request-rounds / (rounds x the part of the batch
            # a gateway runs)): below 1 while clients turn over and the run fills and drains (bench_speed_report.py)
            "slots_filled": chosen[1] / (rounds * batch / n) if rounds else None,
            **{name: int(delta(before, after, name)) for name in COUNTERS.values()},
            "p50_request_s": sorted(t for _, t in results)[len(results) // 2], "ms_per_round": split}
