# services/draft/chain.DraftChain._fill before (CPU tensor ops, 801c100) and after (lists, one
# array) on this 2-core CPU VM (reference attention, no graphs): us per call, every static field equal. Run from the repo root.
import sys, time, importlib.util, torch
sys.path.insert(0, "."); sys.path.insert(0, "tests")
torch.set_num_threads(1)
def before(commit, path):   # the file as it was at commit, written where it can be imported from
    import subprocess, tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout)
    return f.name
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
old = load(before("801c100", "services/draft/chain.py"), "chain_old")
from services.draft.chain import DraftChain
from tests.test_engines import engines, make_models
target, draft = make_models(head_std=0.5)
te, de = engines(target, draft)
for B in (1, 8, 32):
    ids = [f"q{B}-{i}" for i in range(B)]
    for r in ids:
        de.cache.allocate(r); de.cache.extend(r, 100 + 7 * (ids.index(r) % 5))
    ks, starts = [3] * B, [de.cache.length(r) for r in ids]
    for r in ids: de.cache.extend(r, 2)
    hidden = torch.zeros(B, draft.cfg.hidden_size)
    res = []
    for cls in (old.DraftChain, DraftChain):
        ch = cls(draft, de.cache, de.max_model_len, max_k=8, graphs=False)
        bp = old._bucket(B, old.BATCH_BUCKETS)
        graph, st, out = ch._build(bp, 3, False, 1.0)
        ch._fill(st, ids, hidden, ks, starts, bp, 3)
        snap = [st[k].clone() for k in ("pos", "slots", "ctx", "tables")] + [b.host_block_tables.clone() for b in st["batches"]] + [list(b.host_starts) for b in st["batches"]]
        t = time.perf_counter()
        for _ in range(200): ch._fill(st, ids, hidden, ks, starts, bp, 3)
        res.append(((time.perf_counter() - t) / 200 * 1e6, snap))
    same = all((torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b) for a, b in zip(res[0][1], res[1][1]))
    print(f"batch {B}: chain _fill before {res[0][0]:.1f} us, after {res[1][0]:.1f} us, same fields {same}")
