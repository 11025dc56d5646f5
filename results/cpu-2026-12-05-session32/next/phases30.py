# session 30 (not part of Tandem): reads sitecustomize.py's phase logs of one served run (target, draft, gateway) and
# prints, per order of the target's two sends (rows into the ring before / after the next Propose), medians of ms
# after the target's verify compute ends
import glob, json, statistics, sys
procs = {}
for f in glob.glob(sys.argv[1] + "/phases-*.jsonl"):
    recs = [json.loads(line) for line in open(f)]
    names = {r[0] for r in recs}
    role = "target" if "TargetEngine.verify" in names else "draft" if "DraftServicer._propose" in names else "gateway"
    procs[role] = sorted(recs, key=lambda r: r[1])
T, D = procs["target"], procs["draft"]
TAKES = ("IpcReceiver.take_in_place", "SlotHeaders.wait", "RowChannel.take_later")   # the first the probe wrapped


def first(recs, name, after, before=None):
    return next((r for r in recs if r[0] == name and r[1] >= after and (before is None or r[1] < before)), None)
out = {"rows first": [], "Propose first": []}
# the Verify handler as wrapped, else its lane call (a handler bound before the probe patched the class is not wrapped)
verifies = [r for r in T if r[0] == "TargetServicer.Verify"] or [r for r in T if r[0] == "LaneServer._answer"]
for i, tv in enumerate(verifies[8:-1], 8):
    s = first(T, "AheadSender.send", tv[1], tv[2])
    push = first(T, "RowChannel.send", tv[1], tv[2])
    v = first(T, "TargetEngine.verify", tv[1], tv[2])
    if not (s and push and v):
        continue
    pr = first(D, "DraftServicer._propose", s[1] - 0.002)
    if pr is None:
        continue
    wt = next((w for w in (first(D, n, pr[1], pr[2]) for n in TAKES) if w), None)      # the ring take (its wait)
    ep = first(D, "DraftEngine.propose", pr[1], pr[2])
    T0, nxt = v[2], verifies[i + 1]
    d = lambda x: None if x is None else 1000 * (x - T0)
    out["rows first" if push[1] < s[1] else "Propose first"].append({
        "Propose send": (d(s[1]), d(s[2])), "rows push": (d(push[1]), d(push[2])), "draft _propose": (d(pr[1]), d(pr[2])),
        "ring take": (d(wt[1]), d(wt[2])) if wt else (None, None), "draft engine": (d(ep[1]), d(ep[2])) if ep else (None, None),
        "Verify answered": (d(tv[2]), d(tv[2])), "next Verify": (d(nxt[1]), d(nxt[1]))})
for order, rows in out.items():
    print(f"{order}: {len(rows)} rounds; median ms after the target's verify compute (start / end)")
    for k in (rows[0] if rows else {}):
        xs = [[r[k][j] for r in rows if r[k][j] is not None] for j in (0, 1)]
        print(f"  {k:18s} " + " / ".join(f"{statistics.median(x):.3f}" if x else "-" for x in xs))
