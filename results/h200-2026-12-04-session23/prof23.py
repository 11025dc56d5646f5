# Session 23, call E: the MTP draft's Propose as served in one process (V2-Lite random weights, bf16, K = 3, synthetic
# acceptance 0.85): its wall per call (synchronized) at batch 1 and 32, and the kernels of 10 calls under
# torch.profiler, summed per kernel name (device time per call).
import statistics, time
from collections import defaultdict
import torch
from models.presets import random_model_id
from services.draft.engine import DraftEngine
from services.target.synthetic import parse_profile
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", synthetic_acceptance=parse_profile("0.85"))
real = DraftEngine.propose
st = {"walls": [], "left": 0, "ev": defaultdict(float), "calls": 0, "rows": []}
ACT = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def propose(self, items, rows):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    if st["left"] > 0:
        with torch.profiler.profile(activities=ACT) as p:
            out = real(self, items, rows); torch.cuda.synchronize()
        st["left"] -= 1; st["calls"] += 1
        for e in p.key_averages():
            if e.self_device_time_total > 0:
                st["ev"][e.key[:90]] += e.self_device_time_total
    else:
        out = real(self, items, rows); torch.cuda.synchronize()
    st["walls"].append(time.perf_counter() - t0)
    st["rows"].append(sum(len(i.new_token_ids) for i in items))
    return out


DraftEngine.propose = propose
for b in (1, 32):
    prompts = bench_prompts(model, 2 * b, 64, seed=b)
    run_loop(te, de, prompts[:b], 3, b, 64)
    st["walls"], st["rows"] = [], []
    r = run_loop(te, de, prompts, 3, b, 64)
    w = sorted(st["walls"])
    print(f"== batch {b} K 3: {len(w)} proposes, wall median {1e3 * statistics.median(w):.3f} ms (p10 "
          f"{1e3 * w[len(w) // 10]:.3f}, p90 {1e3 * w[9 * len(w) // 10]:.3f}); round split ms "
          f"{ {k: round(1e3 * v / r.rounds, 2) for k, v in r.split.items()} }; rows a call {statistics.mean(st['rows']):.1f}", flush=True)
    st["left"], st["calls"], st["ev"] = 10, 0, defaultdict(float)
    run_loop(te, de, prompts[:b], 3, b, 24)
    total = sum(st["ev"].values()) / max(st["calls"], 1)
    print(f"   kernels of {st['calls']} profiled proposes: {total / 1e3:.3f} ms device time a call")
    for k, v in sorted(st["ev"].items(), key=lambda kv: -kv[1])[:22]:
        print(f"   {v / st['calls']:9.1f} us  {k}")
