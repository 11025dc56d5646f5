# Session 25: the in-process baseline's stall. The first batch-32 K=3 in-process row of a process ran Verify at
# 35-48 ms a round (13-14 in the next grid). Replays run_grid's order (V2-Lite bf16, 0.85, batches 1 and 32, K 0
# and 3, each measure(): warm-up pass, 2-token pass, timed pass) with every target call synchronized and timed,
# with the graph replays / eager steps / captures it caused; then the same grid again in the same process.
import collections, statistics, sys, time, os, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tc25-")
CACHE = os.environ["TRITON_CACHE_DIR"]


def kernels():
    out = set()
    for d, _, fs in os.walk(CACHE):
        out |= {os.path.basename(d) + "/" + f for f in fs if f.endswith(".json") and not f.startswith("__grp")}
    return out


import torch
from models.presets import random_model_id
from services.target.engine import TargetEngine
from services.draft.engine import DraftEngine
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop
from services.config import ServiceConfig
from services.target.synthetic import parse_profile

torch.set_num_threads(ServiceConfig.threads)
import os
DEV = os.environ.get("DEV", "cuda")
model = os.environ.get("MODEL") or random_model_id("v2-lite", 0)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
mem = torch.cuda.memory_reserved if DEV == "cuda" else (lambda: 0)
log = []


def timed(cls, name, info):
    real = getattr(cls, name)

    def f(self, *a, **kw):
        g = self.forward
        k0 = kernels()
        before = (getattr(g, "replays", 0), getattr(g, "eager", 0), len(getattr(g, "graphs", {})))
        sync(); t0 = time.perf_counter()
        out = real(self, *a, **kw); sync()
        after = (getattr(g, "replays", 0), getattr(g, "eager", 0), len(getattr(g, "graphs", {})))
        w = time.perf_counter() - t0
        log.append((name, w, info(a), tuple(x - y for x, y in zip(after, before))))
        if w > 0.05:
            b = self.forward
            print(f"   SLOW {name} {1e3 * w:.1f} ms items {info(a)} new kernels: {sorted(k.split(chr(47))[1][:-5] for k in kernels() - k0)}", flush=True)
        return out
    setattr(cls, name, f)


timed(TargetEngine, "verify", lambda a: (len(a[0]), sum(len(d) + 1 for _, d, _ in a[0])))
timed(TargetEngine, "verify_and_prefill", lambda a: (len(a[0]), sum(len(d) + 1 for _, d, _ in a[0]), [len(t) for _, t, _ in a[2]]))
timed(TargetEngine, "prefill", lambda a: (len(a[0]), 0))
timed(DraftEngine, "propose", lambda a: (len(a[0]), 0))
BATCHES = [int(x) for x in os.environ.get("BATCHES", "1,32").split(",")]
for grid in (1,):
    te, de = make_engines(model, DEV, synthetic_acceptance=parse_profile("0.85"))
    for b in BATCHES:
        prompts = bench_prompts(model, 2 * b, 64, seed=b)
        for k in (0, 3):
            for pas, (ps, mt) in enumerate(((prompts[:b], 64), (prompts[b:], 2), (prompts, 64))):
                log.clear()
                mem0 = mem()
                r = run_loop(te, de, ps, k, b, mt)
                print(f"== grid {grid} batch {b} K={k} pass {pas}: {r.tokens / r.wall_s:.0f} tok/s, {r.rounds} rounds, "
                      f"wall {1e3 * r.wall_s:.1f} ms, reserved +{(mem() - mem0) / 2**20:.0f} MiB",
                      flush=True)
                by = collections.defaultdict(list)
                for name, w, info, g in log:
                    by[name].append((w, info, g))
                for name, calls in by.items():
                    ws = [w for w, _, _ in calls]
                    gs = [sum(x) for x in zip(*(g for _, _, g in calls))]
                    print(f"   {name:18s} {len(calls):4d} calls, total {1e3 * sum(ws):8.1f} ms, median "
                          f"{1e3 * statistics.median(ws):7.3f} ms, max {1e3 * max(ws):7.1f}; replays/eager/captures {gs}")
                if b == BATCHES[-1] and k == 3 and pas == 2:
                    for name, w, info, g in sorted(log, key=lambda x: -x[1])[:25]:
                        print(f"     {name:18s} {1e3 * w:8.2f} ms items {info} replays/eager/captures {g}")
    del te, de
    torch.cuda.empty_cache() if DEV == "cuda" else None
