# Which Python line launches each kernel of a V2-Lite K = 0 batch-1 step (session 20): eager engines (no graphs)
# under torch.profiler with stacks; per kernel name: launches per step, device us, the innermost repo frame.
import collections
import sys

import torch

from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop
from models.presets import random_model_id

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", eager=True)
prompts = bench_prompts(model, 1, 64, seed=1)
run_loop(te, de, prompts, 0, 1, 8)
steps = 8
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts, with_stack=True) as tp:
    run_loop(te, de, prompts, 0, 1, steps + 1)
where = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
for ev in tp.events():
    for k in ev.kernels:
        frames = [f for f in (ev.stack or []) if "/models/" in f or "/kernels/" in f or "/services/" in f]
        w = where[k.name[:60]]
        w[0] += 1
        w[1] += k.duration
        w[2][(ev.name, frames[0] if frames else "?")] += 1
for name, (n, us, sites) in sorted(where.items(), key=lambda kv: -kv[1][1]):
    print(f"{n / steps:7.1f}/step {us / steps:9.1f} us/step  {name}")
    for (op, frame), c in sites.most_common(4):
        print(f"{'':20} {c / steps:6.1f}  {op}  {frame}")
sys.stdout.flush()
