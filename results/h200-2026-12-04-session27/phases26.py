# session 26: the served round's phases (from .gpu/site/sitecustomize.py's records), per process, batch-32 and batch-1
# K = 3 rounds: medians of each call's duration and of the timeline between the target's compute end and the next Verify
import json, statistics, sys, glob, collections, gzip
d = sys.argv[1]
procs = {}
for f in glob.glob(f"{d}/phases-*.jsonl*"):
    recs = [json.loads(l) for l in (gzip.open(f, "rt") if f.endswith(".gz") else open(f))]
    names = {r[0] for r in recs}
    role = "target" if "TargetEngine.verify" in names else "draft" if "DraftEngine.propose" in names else "gateway"
    procs[role] = sorted(recs, key=lambda r: r[1])
T, D, G = procs["target"], procs["draft"], procs["gateway"]
ver = [r for r in T if r[0] in ("TargetEngine.verify", "TargetEngine.verify_and_prefill")]
sends = [r for r in T if r[0] == "AheadSender.send"]
answers = [r for r in T if r[0] == "LaneServer._answer"]
def inside(lst, a, b, name=None):
    return [r for r in lst if r[1] >= a and r[2] <= b and (name is None or r[0] == name)]
rows = []
for a in answers:
    v = inside(ver, a[1], a[2])
    s = inside(sends, a[1], a[2])
    if not v or not s:
        continue
    v, s = v[0], s[0]
    # the draft's push answer that starts after this send
    push = next((r for r in D if r[0] == "DraftServicer._propose" and r[1] >= s[1]), None)
    if push is None:
        continue
    dr = lambda n: inside(D, push[1], push[2], n)
    take = dr("IpcReceiver.take") or dr("IpcReceiver.take_in_place"); gat = dr("DraftServicer._gather_rows"); prop = dr("DraftEngine.propose")
    step = dr("DraftEngine._step"); chain = dr("DraftEngine._chain"); fill = dr("DraftChain._fill")
    # gateway: the Verify call containing this answer, the next collect, the next Verify call
    gv = next((r for r in G if r[0] == "Lane.__call__" and r[1] <= a[1] and r[2] >= a[2]), None)
    if gv is None:
        continue
    com = next((r for r in G if r[0] == "Ending._commit_all" and r[1] >= gv[2]), None)
    col = next((r for r in G if r[0] == "collect" and r[1] >= gv[2]), None)
    nv = next((r for r in G if r[0] == "Lane.__call__" and r[1] > gv[2] and r[2] - r[1] > 0.001 and r[1] > (col[2] if col else 0)), None)
    ms = lambda x: 1000 * x
    rows.append(dict(
        verify_compute=ms(v[2] - v[1]), handler_before=ms(v[1] - a[1]), rows_send_to_ahead=ms(s[1] - v[2]),
        ahead_send=ms(s[2] - s[1]), handler_after_send=ms(a[2] - s[2]),
        push_arrival=ms(push[1] - s[1]), draft_gather=ms(gat[0][2] - gat[0][1]) if gat else -1,
        ipc_take=ms(take[0][2] - take[0][1]) if take else -1,
        take_later=ms(dr("RowChannel.take_later")[0][2] - dr("RowChannel.take_later")[0][1]) if dr("RowChannel.take_later") else -1,
        draft_propose=ms(prop[0][2] - prop[0][1]) if prop else -1, step0=ms(step[0][2] - step[0][1]) if step else -1,
        chain=ms(chain[0][2] - chain[0][1]) if chain else -1, fill=ms(fill[0][2] - fill[0][1]) if fill else -1,
        draft_after_propose=ms(push[2] - prop[0][2]) if prop else -1, draft_total=ms(push[2] - push[1]),
        gw_verify_wall=ms(gv[2] - gv[1]), answer_to_gw=ms(gv[2] - a[2]),
        gw_to_commit=ms(com[1] - gv[2]) if com else -1, commit=ms(com[2] - com[1]) if com else -1,
        collect_start=ms(col[1] - gv[2]) if col else -1, collect_end_vs_draft_done=ms(col[2] - push[2]) if col else -1,
        next_verify_after_collect=ms(nv[1] - col[2]) if (nv and col) else -1,
        draft_done_after_compute=ms(push[2] - v[2]),
        next_verify_after_compute=ms(nv[1] - v[2]) if nv else -1,
        batch_big=v[2] - v[1] > 0.007))
for big in (True, False):
    sel = [r for r in rows if r["batch_big"]]
    sel = sel if big else [r for r in rows if not r["batch_big"]]
    print(f"== {'batch 32' if big else 'batch 1'} K = 3: {len(sel)} rounds (medians, ms)")
    for k in rows[0]:
        if k != "batch_big" and sel:
            vals = [r[k] for r in sel]
            print(f"  {k:28s} {statistics.median(vals):8.3f}  p10 {sorted(vals)[len(vals)//10]:8.3f}  p90 {sorted(vals)[9*len(vals)//10]:8.3f}")
