# session 27: the cProfile probe's files (TANDEM_CPROF_DIR): per key, the top functions by own time, per call of the root
import glob, os, pstats, sys, collections
d = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
keys = collections.defaultdict(list)
for f in sorted(glob.glob(f"{d}/*.prof")):
    keys[os.path.basename(f).rsplit("-", 1)[0]].append(f)
for key, files in sorted(keys.items()):
    st = pstats.Stats(*files)
    root = [(fn, v) for fn, v in st.stats.items() if fn[2] in ("_propose", "Verify", "_commit_all")]
    n = max(v[1] for _, v in root) if root else 1
    tot = max(v[3] for _, v in root) if root else 0
    print(f"== {key}: {n} calls, {1000 * tot / n:.3f} ms a call (cProfile-inflated)")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (cc, nc, tt, ct, _) in rows:
        print(f"  {1000 * tt / n:7.3f} own {1000 * ct / n:7.3f} cum {nc / n:6.1f}x  {os.path.basename(file)}:{line} {name}")
