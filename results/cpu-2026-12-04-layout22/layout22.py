# The step layout of models/kv_cache.PagedKVCache._layout before (CPU tensor ops, f55a545)
# and after (plain lists into one array) on this 2-core CPU VM: us per call, and every field equal. Run from the repo root.
import sys, time, importlib.util, torch
torch.set_num_threads(1)
def before(commit, path):   # the file as it was at commit, written where it can be imported from
    import subprocess, tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout)
    return f.name
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
for label, mod in (("old", load(before("f55a545", "models/kv_cache.py"), "kvo")), ("new", load("models/kv_cache.py", "kvn"))):
    for B, n, ctx in ((1, 1, 100), (32, 1, 100), (32, 4, 100), (1, 4096, 0), (4, 1, 8000)):
        c = mod.PagedKVCache(1, 4096, 16, 8, 4, dtype=torch.float32, device="cpu")
        ids = [f"r{i}" for i in range(B)]
        for r in ids:
            c.allocate(r); c.extend(r, ctx)
        c.extend_ = None
        for r in ids: c.extend(r, n)
        starts = [ctx] * B
        batch = c._layout(ids, [n] * B, starts)
        t = time.perf_counter(); k = 200 if B * n < 1000 else 10
        for _ in range(k):
            b2 = c._layout(ids, [n] * B, starts)
        dt = (time.perf_counter() - t) / k
        print(f"{label} B={B} n={n} ctx={ctx}: {dt*1e6:.1f} us", flush=True)
        if label == "new":
            ref = ref_batches[(B, n, ctx)]
            for f in ("positions", "slot_mapping", "token_request", "context_lens", "query_start", "block_tables", "host_block_tables"):
                a, b = getattr(ref, f), getattr(b2, f)
                assert a.dtype == b.dtype and torch.equal(a, b), (f, a, b)
            assert ref.host_starts == b2.host_starts
        else:
            ref_batches = globals().setdefault("ref_batches", {}); ref_batches[(B, n, ctx)] = batch
