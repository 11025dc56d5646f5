"""Per call marked in a TANDEM_PROFILE_DIR trace (host thread that ran it): wall, device busy inside the span, and
the host time of the call's top-level torch ops vs the rest (Python: parsing, checks, building the answer)."""
import gzip, json, statistics, sys

for path in sys.argv[1:]:
    ev = json.loads(gzip.open(path).read())["traceEvents"]
    name = path.rsplit("/", 1)[-1].split("-")[0]
    calls = [e for e in ev if e.get("name") == name and e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    ops = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    dev = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    rows = []
    for c in calls:
        a, b, tid = c["ts"], c["ts"] + c["dur"], c.get("tid")
        mine = sorted((o["ts"], o["ts"] + o["dur"]) for o in ops if o.get("tid") == tid and a <= o["ts"] < b)
        top, end = 0.0, -1
        for s, t in mine:                       # top-level ops only (nested ones lie inside)
            if s >= end:
                top += t - s; end = t
        busy = 0.0; cur = None
        for s, t in dev:
            if t <= a or s >= b: continue
            s, t = max(s, a), min(t, b)
            if cur is None or s > cur[1]:
                if cur: busy += cur[1] - cur[0]
                cur = [s, t]
            else: cur[1] = max(cur[1], t)
        if cur: busy += cur[1] - cur[0]
        rows.append((b - a, busy, top, b - a - top))
    if not rows:
        print(path, "no calls"); continue
    m = [statistics.median(x) / 1e3 for x in zip(*rows)]
    print(f"{path}: {len(rows)} calls; median wall {m[0]:.2f} ms, device busy {m[1]:.2f}, host in torch ops {m[2]:.2f}, host outside ops {m[3]:.2f}")
