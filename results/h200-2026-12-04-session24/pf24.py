# Session 24, call A: where the batch-32 K=3 "between rounds" goes: every target Prefill / Verify and draft Propose
# of the in-process served loop, synchronized and timed (V2-Lite bf16, 0.85), with its items and tokens computed
import collections, statistics, sys, time
import torch
from models.presets import random_model_id
from services.draft.engine import DraftEngine
from services.target.engine import TargetEngine
from services.target.synthetic import parse_profile
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", synthetic_acceptance=parse_profile("0.85"), graph_batch=32)
log = []


def timed(cls, name, info):
    real = getattr(cls, name)

    def f(self, *a, **kw):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = real(self, *a, **kw); torch.cuda.synchronize()
        log.append((name, time.perf_counter() - t0, info(a, out)))
        return out
    setattr(cls, name, f)


timed(TargetEngine, "prefill", lambda a, o: (len(a[0]), sum(e - s for s, e in zip(o.cached, o.computed))))
timed(TargetEngine, "verify", lambda a, o: (len(a[0]), sum(len(d) + 1 for _, d, _ in a[0])))
timed(DraftEngine, "propose", lambda a, o: (len(a[0]), 0))
for b in (32, 8, 1):
    prompts = bench_prompts(model, 2 * b, 64, seed=b)
    for k in (0, 3):
        run_loop(te, de, prompts[:b], k, b, 64)
        run_loop(te, de, prompts[b:], k, b, 2)
        log.clear()
        r = run_loop(te, de, prompts, k, b, 64)
        print(f"== batch {b} K={k}: {r.tokens / r.wall_s:.0f} tok/s (synchronized calls), {r.rounds} rounds, "
              f"wall {1e3 * r.wall_s:.1f} ms", flush=True)
        by = collections.defaultdict(list)
        for name, w, info in log:
            by[name].append((w, info))
        for name, calls in by.items():
            ws = [w for w, _ in calls]
            print(f"   {name:8s} {len(calls):4d} calls, total {1e3 * sum(ws):7.1f} ms, median {1e3 * statistics.median(ws):.3f} ms")
        pf = collections.Counter()
        for w, (n, t) in by.get("prefill", []):
            pf[(n, t)] += 1
        print("   prefill (items, tokens computed): calls ->", dict(sorted(pf.items())))
        for w, (n, t) in by.get("prefill", [])[:40]:
            print(f"     prefill {n:3d} items {t:5d} tokens {1e3 * w:7.3f} ms")
