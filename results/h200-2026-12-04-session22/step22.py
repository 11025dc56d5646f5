# Session 22: the served bf16 V2-Lite K = 0 verify step's wall (TargetEngine.verify, CUDA graphs), batch 1 and 32,
# median of 60 steps, 3 blocks; run once per tree (old / new host transfers), alternating processes.
import statistics, sys, time, types
import torch
from models.presets import random_model_id
from services.sampling import Sampling
from tandem.bench_fp8_models import _engine

te = _engine(random_model_id("v2-lite", 0), types.SimpleNamespace(device="cuda", small=False), "none", blocks=32 * 16 + 64)
cfg = te.model.cfg
for batch in (1, 32):
    g = torch.Generator().manual_seed(batch)
    ids = [f"p{batch}-{i}" for i in range(batch)]
    te.prefill([(r, torch.randint(cfg.vocab_size, (64,), generator=g).tolist(), Sampling()) for r in ids])
    for _ in range(5):
        te.verify([(r, [], None) for r in ids])
    walls = []
    for _ in range(60):
        t = time.perf_counter(); te.verify([(r, [], None) for r in ids]); walls.append(time.perf_counter() - t)
    print(f"== {sys.argv[1]} batch {batch}: {1000 * statistics.median(walls):.3f} ms a step (median of 60; "
          f"p10 {1000 * sorted(walls)[6]:.3f}, p90 {1000 * sorted(walls)[54]:.3f})", flush=True)
    te.release(ids)
