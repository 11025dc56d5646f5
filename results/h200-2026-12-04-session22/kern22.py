# Session 22: where the served bf16 V2-Lite K = 0 verify step goes at batch 1 (and 32), kernel by kernel, as captured
# (CUDA graphs). PDL on/off is read at capture, so run this once per setting: python3 .gpu/kern22.py LABEL
import collections, statistics, sys, time, types
import torch
from models.presets import random_model_id
from services.sampling import Sampling
from tandem.bench_fp8_models import _engine

label = sys.argv[1]
q = sys.argv[2] if len(sys.argv) > 2 else "none"
a = types.SimpleNamespace(device="cuda", small=False)
te = _engine(random_model_id("v2-lite", 0), a, q, blocks=32 * 16 + 64)
cfg = te.model.cfg
for batch in (1, 32):
    g = torch.Generator().manual_seed(batch)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    te.prefill([(r, torch.randint(cfg.vocab_size, (64,), generator=g).tolist(), Sampling()) for r in ids])
    step = lambda: te.verify([(r, [], None) for r in ids])
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(30):
        t = time.perf_counter(); step(); torch.cuda.synchronize(); walls.append(time.perf_counter() - t)
    n = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = collections.defaultdict(list)
    for e in kern:
        by[e.name[:90]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    busy = sum(sum(v) for v in by.values()) / n
    spans = sorted((e.time_range.start, e.time_range.end) for e in kern)
    first, last = spans[0][0], max(s[1] for s in spans)
    print(f"== {label} {q} batch {batch}: wall {1000*statistics.median(walls):.3f} ms a step (median of 30), "
          f"{len(kern)/n:.0f} kernels a step, kernel time summed {busy/1000:.3f} ms a step, "
          f"profiled span {(last-first)/n/1000:.3f} ms a step")
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))
    for name, v in rows[:40]:
        print(f"{sum(v)/n:9.1f} us/step {len(v)/n:6.1f} x {statistics.mean(v):7.2f} us  {name}")
    te.release(ids)
