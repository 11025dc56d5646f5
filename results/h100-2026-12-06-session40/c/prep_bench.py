import time, torch, statistics as st
from models.kv_cache import PagedKVCache
from models.batch import Stage
def bench(B, q):
    cache = PagedKVCache(2, 8192, 16, 64, 16)
    stage = Stage.new(max(B * q, 8), B, 256, 0, "cpu", [])
    cache.staging = lambda b, N, w: stage if (b == B and N == B * q) else None
    ids = [f"r{i}" for i in range(B)]
    for i, r in enumerate(ids):
        cache.allocate(r); cache.prepare([r], [100 + 7 * i])
    toks = list(range(B * q))
    ts = []
    for i in range(600):
        t = time.perf_counter(); cache.prepare(ids, [q] * B, toks); ts.append(time.perf_counter() - t)
        for r in ids: cache.rollback(r, q)
    return st.median(ts[100:]) * 1e6
for B, q in ((1, 1), (1, 4), (8, 4), (32, 1), (32, 4), (64, 4)):
    print(f"B={B} q={q}: prepare {bench(B, q):.1f} us")
