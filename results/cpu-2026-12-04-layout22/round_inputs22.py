# services/target/engine._round_inputs before (CPU tensor ops, 801c100) and after (lists into one
# array) on this 2-core CPU VM: us per call, outputs equal. Run from the repo root.
import sys, time, importlib.util, torch
torch.set_num_threads(1)
sys.path.insert(0, ".")
def before(commit, path):   # the file as it was at commit, written where it can be imported from
    import subprocess, tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout)
    return f.name
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
old, new = load(before("801c100", "services/target/engine.py"), "eo"), load("services/target/engine.py", "en")
for drafts in ([[]], [[5, 6, 7]], [[1], [], [2, 3, 4], [9, 9]], [[i, i + 1, i + 2] for i in range(32)], [[] for _ in range(32)]):
    a, b = old._round_inputs(drafts, "cpu"), new._round_inputs(drafts, "cpu")
    assert torch.equal(a[0], b[0]) and a[1].tolist() == b[1]
    for x, y in zip(a[3:], b[2:]):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)
    ts = []
    for f in (old._round_inputs, new._round_inputs):
        t = time.perf_counter()
        for _ in range(300): f(drafts, "cpu")
        ts.append((time.perf_counter() - t) / 300 * 1e6)
    print(f"B={len(drafts)} K={max(map(len, drafts))}: before {ts[0]:.1f} us, after {ts[1]:.1f} us, equal")
