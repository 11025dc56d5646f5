"""Session 13 probe: (1) bmm writing into a transposed view of a padded buffer stays in place; (2) an eager
K = 0 batch-1 verify step of the V2-Lite preset: aten ops and kernels per step, to name the copies."""
import sys
import time

import torch

from models.presets import random_model_id
from tandem.bench_inprocess import make_engines, run_loop

a = torch.randn(16, 1, 512, dtype=torch.bfloat16, device="cuda")
w = torch.randn(16, 128, 512, dtype=torch.bfloat16, device="cuda")
buf = torch.empty(128, 16 * 128, dtype=torch.bfloat16, device="cuda")
out = buf[:1]
ptr = out.data_ptr()
r = torch.bmm(a, w.transpose(1, 2), out=out.view(1, 16, 128).transpose(0, 1))
ref = torch.einsum("hnr,hvr->nhv", a, w).reshape(1, -1)
print("bmm in place:", r.data_ptr() == ptr or r.data_ptr() == out.view(1, 16, 128).transpose(0, 1).data_ptr(),
      "values equal einsum:", torch.equal(out, ref), "max diff", (out.float() - ref.float()).abs().max().item())
for n in (1, 4, 32, 128):
    a = torch.randn(16, n, 512, dtype=torch.bfloat16, device="cuda")
    o = torch.empty(max(n, 128), 2048, dtype=torch.bfloat16, device="cuda")[:n]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        torch.bmm(a, w.transpose(1, 2), out=o.view(n, 16, 128).transpose(0, 1))
        torch.cuda.synchronize()
    print(n, "rows: kernels", [e.key[:60] for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA])

mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
te, de = make_engines(random_model_id("v2-lite", 0), "cuda", synthetic_acceptance=(0.85,), eager=mode == "eager")
prompts = [[(i * 7 + j) % 1000 + 5 for j in range(64)] for i in range(2)]
run_loop(te, de, prompts[:1], 0, 1, 8)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    res = run_loop(te, de, prompts[1:], 0, 1, 17)
steps = res.rounds
print(mode, "rounds", steps, "wall ms a round", res.wall_s / steps * 1e3)
ev = p.key_averages()
print(ev.table(sort_by="count", row_limit=60, max_name_column_width=70))
