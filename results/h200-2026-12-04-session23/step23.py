# Session 23: the served bf16 V2-Lite verify step's wall (TargetEngine.verify, CUDA graphs), batch 1 and 32, K = 0
# (decode) and K = 3 (4 rows a request, random drafts), median of 60 steps; one process per tree, alternating.
import statistics, sys, time, types
import torch
from models.presets import random_model_id
from services.sampling import Sampling
from tandem.bench_fp8_models import _engine

te = _engine(random_model_id("v2-lite", 0), types.SimpleNamespace(device="cuda", small=False), "none", blocks=32 * 40 + 64)
cfg = te.model.cfg
for batch in (1, 32):
    for K in (0, 3):
        g = torch.Generator().manual_seed(batch)
        ids = [f"p{batch}-{K}-{i}" for i in range(batch)]
        te.prefill([(r, torch.randint(cfg.vocab_size, (64,), generator=g).tolist(), Sampling()) for r in ids])
        items = lambda: [(r, torch.randint(3, cfg.vocab_size, (K,), generator=g).tolist(), None) for r in ids]
        for _ in range(5):
            te.verify(items())
        walls = []
        for _ in range(60):
            it = items()
            t = time.perf_counter(); te.verify(it); walls.append(time.perf_counter() - t)
        print(f"== {sys.argv[1]} batch {batch} K {K}: {1000 * statistics.median(walls):.3f} ms a step (median of 60; "
              f"p10 {1000 * sorted(walls)[6]:.3f}, p90 {1000 * sorted(walls)[54]:.3f})", flush=True)
        te.release(ids)
