# Which Python lines issue the device-to-device copies of a V2-Lite K = 0 batch-1 step (session 21): eager engines
# under a TorchDispatchMode that records the repo frames of every copy-like aten op on CUDA tensors.
import collections, traceback, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop
from models.presets import random_model_id

COPY = ("copy", "clone", "_to_copy", "contiguous", "cat", "index_put", "fill", "zero", "stack", "as_strided_scatter",
        "slice_scatter", "expand_copy", "repeat")
seen = collections.Counter()
ops = collections.Counter()
class Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        ops[name] += 1
        if any(c in name for c in COPY):
            t = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            if t and t[0].is_cuda:
                fr = [f"{f.filename.split('/main/')[-1].split('/root/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                      if any(d in f.filename for d in ("models/", "kernels/", "services/", "tandem/"))]
                seen[(name, " < ".join(reversed(fr[-3:])))] += 1
        return func(*args, **(kwargs or {}))

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", eager=True)
prompts = bench_prompts(model, 1, 64, seed=1)
run_loop(te, de, prompts, 0, 1, 4)
seen.clear(); ops.clear()
with Mode():
    run_loop(te, de, prompts, 0, 1, 5)
print("copy-like ops on CUDA tensors over the run (prefill + 5 steps):")
for (name, where), n in seen.most_common(40):
    print(f"{n:6d}  {name}  {where}")
print("\nall aten ops:")
for name, n in ops.most_common(60):
    print(f"{n:6d}  {name}")
