# session 39: phases36 with the early push's phases
# session 35 (not part of Tandem): reads site35/sitecustomize.py's phase logs of one served run (target, draft,
# gateway) and prints, per round, medians (p10 / p90) of ms after the target's verify compute ends, of each phase's start and end
import glob, json, statistics, sys
procs = {}
for f in glob.glob(sys.argv[1] + "/phases-*.jsonl"):
    recs = [json.loads(line) for line in open(f)]
    names = {r[0] for r in recs}
    role = "target" if "TargetServicer.Verify" in names or "TargetEngine.verify" in names else \
        "draft" if "DraftServicer._propose" in names else "gateway"
    procs[role] = sorted(recs, key=lambda r: r[1])
T, D, G = procs["target"], procs["draft"], procs.get("gateway", [])
print("names:", {k: sorted({r[0] for r in v}) for k, v in procs.items()})
def first(recs, name, after, before=None):
    return next((r for r in recs if r[0] == name and r[1] >= after and (before is None or r[1] < before)), None)
def every(recs, name, after, before):
    return [r for r in recs if r[0] == name and after <= r[1] < before]
verifies = [r for r in T if r[0] == "TargetServicer.Verify"] or [r for r in T if r[0] == "LaneServer._answer"]
rows = []
for i, tv in enumerate(verifies[8:-1], 8):
    nxt = verifies[i + 1]
    v = first(T, "TargetEngine.verify", tv[1], tv[2]) or first(T, "TargetEngine.verify_and_prefill", tv[1], tv[2])
    s = first(T, "AheadSender.send", tv[1], tv[2])
    if not (v and s):
        continue
    T0 = v[2]
    d = lambda x: 1000 * (x - T0)
    row = {"target Verify handler": (tv[1], tv[2]), "target engine verify": (v[1], v[2]), "Propose push send": (s[1], s[2])}
    pa = first(T, "TargetServicer._push_acceptance", tv[1], tv[2])
    if pa: row["target early push"] = (pa[1], pa[2])
    push = first(T, "RowChannel.send", tv[1], tv[2])
    if push: row["rows push"] = (push[1], push[2])
    for name, label in (("DraftServicer._pass", "draft merged pass"), ("DraftServicer._propose", "draft _propose"),
                        ("IpcReceiver.take_in_place", "ring take"), ("RowChannel.take_later", "take_later"),
                        ("DraftEngine.propose", "draft engine"), ("DraftEngine._chain", "engine _chain"),
                        ("DraftChain._fill", "chain _fill"), ("DraftChain.run", "chain run"), ("DraftEngine.seal", "seal"),
                        ("DraftServicer._early", "draft early pass"), ("propose_early", "early engine"),
                        ("_accepted", "acceptance on draft host"), ("PagedKVCache.prepare", "prepare (first)")):
        r = first(D, name, s[1] - 0.002, nxt[1])
        if r: row[label] = (r[1], r[2])
    st = every(D, "DraftEngine._step", s[1] - 0.002, nxt[1])
    if st: row["engine _step (first)"] = (st[0][1], st[0][2])
    for name, label in (("Scheduler._join", "gw _join"), ("Ending._commit_all", "gw commit"), ("after_verify", "gw after_verify"),
                        ("collect", "gw collect"), ("plan_ahead", "gw plan_ahead")):
        r = first(G, name, tv[1], nxt[1])
        if r: row[label] = (r[1], r[2])
    row["next Verify"] = (nxt[1], nxt[1])
    rows.append({k: (d(a), d(b)) for k, (a, b) in row.items()})
print(f"{len(rows)} rounds; ms after the target's verify compute ends: median start / end (p10-p90 of end)")
keys = []
for r in rows:
    keys += [k for k in r if k not in keys]
def q(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(p * len(xs)))]
for k in keys:
    a = [r[k][0] for r in rows if k in r]; b = [r[k][1] for r in rows if k in r]
    print(f"  {k:24s} {statistics.median(a):8.3f} / {statistics.median(b):8.3f}  ({q(b, .1):.3f}-{q(b, .9):.3f})  n={len(a)}")
# session 36: per call of the draft's _propose and of the target's Verify handler, the median time of every wrapped
# function inside it (same thread), and where in the call it starts
for role, outer in (("draft", "DraftServicer._propose"), ("target", "TargetServicer._guard"), ("draft", "DraftServicer._early")):
    recs = procs[role]
    calls = [r for r in recs if r[0] == outer][8:]
    agg, at = {}, {}
    for c in calls:
        inside = [r for r in recs if c[1] <= r[1] and r[2] <= c[2] and r[3] == c[3] and r is not c]
        s, first = {}, {}
        for r in inside:
            s[r[0]] = s.get(r[0], 0.0) + r[2] - r[1]
            first.setdefault(r[0], r[1] - c[1])
        for k, v in s.items():
            agg.setdefault(k, []).append(1000 * v)
            at.setdefault(k, []).append(1000 * first[k])
    print(f"\n{role} {outer}: {len(calls)} calls; inside it, median ms (summed a call) and first start (ms into the call)")
    for k in sorted(agg, key=lambda k: statistics.median(at[k])):
        print(f"  {k:32s} {statistics.median(agg[k]):7.3f}   at {statistics.median(at[k]):7.3f}  n={len(agg[k])}")
