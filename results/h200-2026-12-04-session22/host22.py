# Session 22: (1) PDL on vs off in ONE process: two CUDA-graph captures of the V2-Lite target step (TANDEM_PDL read at
# capture), pure graph replays timed with CUDA events, interleaved blocks; (2) where a served batch-1 K = 0 verify
# step's wall goes on the host: cProfile of 60 steps, and a torch.profiler timeline of one step (CPU ops at top level,
# kernels outside the graph, the graph's first/last kernel).
import cProfile, io, os, pstats, statistics, sys, types
import torch
from models.presets import random_model_id
from models.cuda_graphs import GraphedForward
from models.runner import new_cache
from services.sampling import Sampling
from tandem.bench_fp8_models import _engine

a = types.SimpleNamespace(device="cuda", small=False)
te = _engine(random_model_id("v2-lite", 0), a, "none", blocks=32 * 16 + 64)
model, cfg = te.model, te.model.cfg

# (2) host side of the served step at batch 1
ids = ["h0"]
te.prefill([(r, list(range(5, 69)), Sampling()) for r in ids])
step = lambda: te.verify([(r, [], None) for r in ids])
for _ in range(10):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile(); prof.enable()
for _ in range(60):
    step()
prof.disable()
s = io.StringIO(); st = pstats.Stats(prof, stream=s).strip_dirs()
st.sort_stats("tottime").print_stats(30); st.sort_stats("cumulative").print_stats(45)
print(s.getvalue())
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
    for _ in range(3):
        with torch.profiler.record_function("STEP"):
            step()
    torch.cuda.synchronize()
ev = sorted(tp.events(), key=lambda e: e.time_range.start)
steps = [e for e in ev if e.name == "STEP"]
last = steps[-1]
t0 = last.time_range.start
print(f"== one step under the profiler: {(last.time_range.end - t0):.0f} us")
kern = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= t0 - 50]
cpu = [e for e in ev if e.device_type != torch.autograd.DeviceType.CUDA and t0 <= e.time_range.start <= last.time_range.end]
top = []
for e in cpu:                                    # top-level CPU ops only (not inside another listed op)
    if not any(o.time_range.start <= e.time_range.start and e.time_range.end <= o.time_range.end and o is not e
               and o.name != "STEP" for o in cpu):
        top.append(e)
for e in top:
    print(f"cpu {e.time_range.start - t0:8.1f} +{e.time_range.end - e.time_range.start:7.1f}  {e.name[:80]}")
print(f"kernels: {len(kern)}, first at {kern[0].time_range.start - t0:.1f}, last ends {max(k.time_range.end for k in kern) - t0:.1f}")
prev = None
for k in kern:
    gap = k.time_range.start - prev.time_range.end if prev else 0
    if gap > 4 or prev is None:
        print(f"gpu {k.time_range.start - t0:8.1f} +{k.time_range.end - k.time_range.start:6.1f} after gap {gap:6.1f}  {k.name[:70]}")
    prev = k
small = sum(max(0, k.time_range.start - p.time_range.end) for p, k in zip(kern, kern[1:]) if k.time_range.start - p.time_range.end <= 4)
print(f"sum of gaps <= 4 us: {small:.0f} us over {len(kern)} kernels")
