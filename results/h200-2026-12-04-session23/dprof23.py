# Session 23, call F: where the MTP draft's Propose spends its host time (cProfile of the Propose calls of the served
# round in one process, V2-Lite random weights, bf16, K = 3, synthetic acceptance 0.85), batch 1 and 32.
import cProfile, io, pstats
import torch
from services.draft.engine import DraftEngine
from services.target.synthetic import parse_profile
from models.presets import random_model_id
from tandem.bench import bench_prompts
from tandem.bench_inprocess import make_engines, run_loop

model = random_model_id("v2-lite", 0)
te, de = make_engines(model, "cuda", synthetic_acceptance=parse_profile("0.85"))
real, prof = DraftEngine.propose, [None]


def propose(self, items, rows):
    if prof[0] is None:
        return real(self, items, rows)
    prof[0].enable()
    try:
        return real(self, items, rows)
    finally:
        prof[0].disable()


DraftEngine.propose = propose
for b in (1, 32):
    prompts = bench_prompts(model, 2 * b, 64, seed=b)
    run_loop(te, de, prompts[:b], 3, b, 64)
    run_loop(te, de, prompts[b:], 3, b, 2)
    prof[0] = cProfile.Profile()
    r = run_loop(te, de, prompts, 3, b, 64)
    p, prof[0] = prof[0], None
    s = io.StringIO(); st = pstats.Stats(p, stream=s).strip_dirs()
    st.sort_stats("tottime").print_stats(28); st.sort_stats("cumulative").print_stats(40)
    print(f"== batch {b} K 3, {r.rounds} rounds\n" + s.getvalue(), flush=True)
