"""`tandem bench speed`'s report: the Markdown table of its rows and the plot.

Between rounds is the run's wall per round less the round's own time: Prefill and re-sync calls (also
in the JSON: prefill, resync) and a request's turnover. Re-probes: parked requests the adaptive policy woke.

RPC overhead is what the round spent in its two calls beyond the services' own work: (propose - transfer -
draft compute) + (verify - target compute), each call's part in brackets (issue 14 asks <= 0.3 ms a service). With overlapped rounds (gateway/proposals.py) "propose" is only
the round's wait for drafts the commit did not hide, so that figure can go below zero: the overlap won back
more than the hop cost. Hops: the one-way times of both calls' messages, request (written by the gateway ->
taken by the service's stream handler) / response (built by the handler -> read by the gateway), from the
services' CLOCK_MONOTONIC stamps (CallTiming received_at / answered_at: services on the gateway's host), then
the handlers' time around their timed work (service: lock, parsing, checks, building the response); the rest
of the overhead is the gateway's own work around the calls.

Batch slots filled: the decoding request-rounds the gateway counted (tandem:spec_decode_chosen_k) over rounds x
batch. A slot is empty while its client turns over (a finished request's answer -> the next request -> its prompt
rides a Verify, not counted, and it joins the round after) and while the run fills and drains. Those cost about
the same rounds at any K, and a request takes ~MAL times fewer rounds at K > 0, so a K > 0 row fills fewer of its
slots than K = 0 does: its speedup is below what a server with requests waiting would give.
"""
from __future__ import annotations

from pathlib import Path


def table(rows: list[dict]) -> str:
    inproc = any("inprocess_tokens_per_s" in r for r in rows)
    head = ["acceptance", "batch", "K", "served tok/s", "run spread", "speedup vs K=0", "mean acc. length",
            "batch slots filled", "round ms", "propose ms",
            "transfer ms", "draft compute ms", "verify ms", "target compute ms", "RPC overhead ms (draft / target)",
            "hops ms (request / response / service)", "gateway ms",
            "between rounds ms", "re-probes"]
    head += ["in-process tok/s", "in-process speedup", "served / in-process"] if inproc else []
    head += ["ideal round ms", "ideal tok/s", "served of ideal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["ms_per_round"]
        ms = (lambda ph: f"{s[ph]:.2f}") if s else (lambda ph: "")
        draft, target = ((s["propose"] - s["transfer"] - s["draft_compute"], s["verify"] - s["target_compute"])
                         if s else (0.0, 0.0))
        rpc = f"{draft + target:.2f} ({draft:.2f} / {target:.2f})" if s else ""
        cells = [r["acceptance"], r["batch"], k_name(r, True), f"{r['tokens_per_s']:.1f}",
                 f"{r['spread']:.0%}" if len(r.get("tokens_per_s_runs", [])) > 1 else "", f"{r['speedup']:.2f}",
                 f"{r['mean_acceptance_length']:.2f}",
                 f"{r['slots_filled']:.0%}" if r.get("slots_filled") is not None else "",
                 ms("round"), ms("propose"), ms("transfer"), ms("draft_compute"), ms("verify"), ms("target_compute"),
                 rpc, hops(s), ms("gateway"),
                 f"{s['between']:.2f}" if "between" in s else "", r.get("reprobes", "")]
        if inproc:
            cells += [f"{r['inprocess_tokens_per_s']:.1f}", f"{r['inprocess_speedup']:.2f}",
                      f"{r['served_over_inprocess']:.2f}"] if "inprocess_tokens_per_s" in r else ["", "", ""]
        cells += [f"{r['ideal_round_ms']:.2f}", f"{r['ideal_tokens_per_s']:.0f}", f"{r['of_ideal']:.0%}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def hops(s: dict) -> str:
    return (f"{s['rpc_request']:.2f} / {s['rpc_response']:.2f} / {s.get('rpc_service', 0.0):.2f}"
            if "rpc_request" in s else "")


def k_name(r: dict, mean: bool = False) -> str:
    """A row's K: the fixed K, or the adaptive cap (and the mean k chosen); then the gateway's variant: "serial"
    without overlapped rounds, "no-ahead" with each Propose sent by the gateway."""
    mode = r.get("speculation", "fixed")
    variant = " " + mode.partition("/")[2] if "/" in mode else ""       # serial, no-ahead (bench_speed.VARIANTS)
    if not mode.startswith("adaptive"):
        return str(r["k"]) + variant
    return f"adaptive <= {r['k']}" + (f" (mean {r['mean_k']:.2f})" if mean else "") + variant


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for acc, k in sorted({(r["acceptance"], k_name(r)) for r in rows}):
        rs = [r for r in rows if k_name(r) == k and r["acceptance"] == acc]
        name = f"K={k}" if k == "0" or len({r["acceptance"] for r in rows}) == 1 else f"K={k} ({acc})"
        if k == "0" and acc != rows[0]["acceptance"]:
            continue                                   # K = 0 does not depend on the acceptance profile
        ax.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=f"served {name}")
        if all("inprocess_tokens_per_s" in r for r in rs):
            ax.plot([r["batch"] for r in rs], [r["inprocess_tokens_per_s"] for r in rs], marker="x",
                    linestyle="--", label=f"in-process {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("decode tokens / s")
    ax.grid(alpha=0.3)
    ax.legend()
    parts = [("transfer", "transfer"), ("draft_compute", "draft compute"), ("rpc", "RPC overhead"),
             ("target_compute", "target compute"), ("gateway", "gateway")]
    split = [r for r in rows if r["ms_per_round"]]
    bottom = [0.0] * len(split)
    for key, label in parts:
        vals = []
        for r in split:
            s = r["ms_per_round"]
            vals.append(s["propose"] - s["transfer"] - s["draft_compute"] + s["verify"] - s["target_compute"]
                        if key == "rpc" else s[key])
        bx.bar(range(len(split)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(range(len(split)), [f"B{r['batch']} K{k_name(r)} {r['acceptance']}" for r in split], rotation=45,
                  fontsize=7)
    bx.set_ylabel("ms per round (served)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def expected_lengths(profiles: list[str], ks: str) -> str:
    """What each synthetic profile's draws average to at the largest K: a row's mean acceptance length is its own
    seeded draws (few at batch 1), so a row above or below this is luck, not speed."""
    from services.target.synthetic import expected_acceptance_length, parse_profile
    k = max(int(x) for x in ks.split(","))
    return (f"expected mean acceptance length at K = {k}: "
            + " / ".join(f"{expected_acceptance_length(parse_profile(p), k):.2f}" for p in profiles if p))
