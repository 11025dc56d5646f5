import sys, torch
torch.set_num_threads(1)
from pathlib import Path
from tandem.bench_inprocess import make_engines, run_loop
from tandem.bench import bench_prompts
from models.tiny import default_model
m = str(default_model())
te, de = make_engines(m, quantization="fp8", num_blocks=1024)
prompts = bench_prompts(m, 32, 64, 0)
plain = run_loop(te, de, prompts, k=0, batch=1, max_tokens=48)
spec = run_loop(te, de, prompts, k=3, batch=1, max_tokens=48)
same = sum(a == b for a, b in zip(plain.outputs, spec.outputs))
print(f"fp8 CPU K=3 equals K=0 in {same} of {len(prompts)} prompts (batch 1, 48 tokens); drafts {spec.drafts}")
