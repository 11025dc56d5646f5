# Session 23, call G: the draft's Propose wall (synchronized) as served in one process, V2-Lite bf16, K = 3, 0.85
import statistics, sys, time
import torch
from models.presets import random_model_id
from services.draft.engine import DraftEngine
from services.target.synthetic import parse_profile
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", synthetic_acceptance=parse_profile("0.85"), graph_batch=32)
real, walls = DraftEngine.propose, []


def propose(self, items, rows):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    out = real(self, items, rows); torch.cuda.synchronize()
    walls.append(time.perf_counter() - t0)
    return out


DraftEngine.propose = propose
for b in (1, 32):
    prompts = bench_prompts(model, 2 * b, 64, seed=b)
    run_loop(te, de, prompts[:b], 3, b, 64)
    walls.clear()
    r = run_loop(te, de, prompts, 3, b, 64)
    w = sorted(walls)
    print(f"== {sys.argv[1]} batch {b}: propose {1e3 * statistics.median(w):.3f} ms (p10 {1e3 * w[len(w) // 10]:.3f}, "
          f"p90 {1e3 * w[9 * len(w) // 10]:.3f}, {len(w)} calls); {r.tokens / r.wall_s:.0f} tok/s in process", flush=True)
