# Session 24, call B: which eager step shapes compile kernels mid-serving (the in-process "one-off prefill stall"):
# after the engines' start (graphs captured up to batch 64) and one 32 x 64 prefill, prefills and mixed steps of
# new shapes, each timed twice (first / again with new ids) with the Triton kernels compiled in between named
import os, sys, tempfile, time
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tc24-")
import torch
from models.presets import random_model_id
from services.sampling import Sampling
from tandem.bench_inprocess import make_engines

CACHE = os.environ["TRITON_CACHE_DIR"]


def kernels() -> set[str]:
    out = set()
    for d, _, fs in os.walk(CACHE):
        out |= {os.path.join(os.path.basename(d), f) for f in fs if f.endswith(".json") and not f.startswith("__grp")}
    return out


model = random_model_id("v2-lite", 0)
t0 = time.perf_counter()
te, de = make_engines(model, "cuda")
print(f"   engines built (graphs captured, eager sizes run) in {time.perf_counter() - t0:.1f} s; kernels compiled: "
      f"{len(kernels())}", flush=True)
g = torch.Generator().manual_seed(0)
n = [0]


def prompts(b, t):
    n[0] += 1
    return [(f"p{n[0]}-{i}", torch.randint(5, 1000, (t,), generator=g).tolist(), Sampling()) for i in range(b)]


def timed(what, fn):
    before = kernels()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    fn(); torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0)
    new = sorted(k.split("/")[1].removesuffix(".json") for k in kernels() - before)
    print(f"   {what:40s} {ms:8.1f} ms  new kernels: {len(new)} {new[:12]}", flush=True)


timed("prefill 32 x 64 (bench start)", lambda: te.prefill(prompts(32, 64)))
for b, t in [(14, 64), (3, 200), (16, 40), (17, 33), (1, 600), (5, 127), (2, 300), (40, 64)]:
    for rep in ("first", "again"):
        timed(f"prefill {b} x {t} ({rep})", lambda: te.prefill(prompts(b, t)))
    te.release(list(te.requests))
run = prompts(32, 64)
te.prefill(run)
items = [(rid, [te.requests[rid].pending_token] * 3, None) for rid, _, _ in run]
for b, t in [(2, 64), (5, 64), (14, 64), (3, 77)]:
    for rep in ("first", "again"):
        def mixed():
            v, p = te.verify_and_prefill(items, None, prompts(b, t))
            assert not isinstance(p, Exception), p
            for rid, d, q in items:
                te.cache.rollback(rid, 0)
        timed(f"verify 32 x 4 + prefill {b} x {t} ({rep})", mixed)
        items = [(rid, [te.requests[rid].pending_token] * 3, None) for rid, _, _ in run]
timed("verify 32 x 4 alone", lambda: te.verify(items))
print("eager steps:", te.forward.eager, "replays:", te.forward.replays)
