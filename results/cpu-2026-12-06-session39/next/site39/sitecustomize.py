# session 39 probe: session 36's with the early push (services/draft/early.py)
# session 36 probe (not part of Tandem): session 35's with the draft's take, the target's send and the step's layout split finer
# session 26 probe (not part of Tandem): with TANDEM_PHASES_DIR set, every process of a served run wraps the round's
# functions below and writes (name, start, end, thread) per call, CLOCK_MONOTONIC (one clock for the host), to
# DIR/phases-<pid>.jsonl; patched as each module appears (a poller thread), before the first round.
import os
DIR = os.environ.get("TANDEM_PHASES_DIR", "")
if DIR:
    import atexit, functools, inspect, json, sys, threading, time
    TARGETS = {
        "services.draft.server": ["DraftServicer._propose", "DraftServicer._gather_rows", "DraftServicer.Propose",
                                  "check", "check_payload", "rows_by_request", "_landed", "DraftServicer._item", "DraftServicer._pass", "DraftServicer._ride", "DraftServicer._early"],
        "services.draft.early": ["propose_early", "check_items", "_accepted", "_to_host"],
        "services.bridge.channel": ["RowChannel.take", "RowChannel.send", "RowChannel.take_later", "RowChannel._take",
                                    "finite_flag", "_typed"],
        "services.bridge.rows": ["describe"],
        "services.bridge.ipc": ["IpcReceiver.take", "IpcReceiver.take_in_place", "IpcSender.push", "SlotHeaders.wait",
                                "SlotHeaders.publish"],
        "models.cuda_graphs": ["GraphedForward.__call__"],
        "services.draft.engine": ["DraftEngine.propose", "DraftEngine._step", "DraftEngine._chain", "DraftEngine.expected_rows", "DraftEngine._pick", "DraftEngine.seal", "DraftEngine.propose_early", "DraftEngine._loop"],
        "services.draft.chain": ["DraftChain.run", "DraftChain._fill"],
        "services.draft.ahead": ["AheadStore.collect"],
        "models.kv_cache": ["PagedKVCache.prepare"],
        "services.lane": ["LaneServer._answer"],
        "services.target.server": ["TargetServicer._rows", "TargetServicer.Verify", "TargetServicer.Prefill", "TargetServicer._describe", "TargetServicer._guard", "TargetServicer._push_acceptance", "TargetServicer._push_verified"],
        "services.target.engine": ["TargetEngine.verify", "TargetEngine.verify_and_prefill", "TargetEngine.results"],
        "services.target.ahead": ["AheadSender.send"],
        "gateway.scheduler": ["Scheduler._round", "Scheduler.step", "Scheduler._join"],
        "gateway.ending": ["Ending._commit_all"],
        "gateway.proposals": ["collect", "after_verify", "plan_ahead", "collect_joined", "send", "join"],
        "gateway.lanes": ["Lane.__call__"],
    }
    recs, lock = [], threading.Lock()
    path = os.path.join(DIR, f"phases-{os.getpid()}.jsonl")
    os.makedirs(DIR, exist_ok=True)
    def flush():
        with lock:
            out, recs[:] = list(recs), []
        if out:
            with open(path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in out))
    def note(name, t0, t1):
        recs.append((name, t0, t1, threading.get_ident() % 100000))
        if len(recs) > 2000:
            flush()
    def wrap(name, fn):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def aw(*a, **k):
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    note(name, t0, time.perf_counter())
            return aw
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                note(name, t0, time.perf_counter())
        return w
    def patch(mod):
        done = True
        for q in TARGETS[mod.__name__]:
            owner, attr = (mod, q) if "." not in q else (getattr(mod, q.split(".")[0], None), q.split(".")[1])
            fn = getattr(owner, attr, None) if owner is not None else None
            if fn is not None and not getattr(fn, "_phased", False):
                w = wrap(q, fn); w._phased = True
                setattr(owner, attr, w)
            elif fn is None:
                done = False
        return done
    def poll():
        left = set(TARGETS)
        while left:
            for m in list(left):
                mod = sys.modules.get(m)
                if mod is not None and getattr(mod, "__spec__", None) is not None:
                    try:
                        if patch(mod):
                            left.discard(m)
                    except Exception:
                        pass
            time.sleep(0.05)
    threading.Thread(target=poll, daemon=True).start()
    atexit.register(flush)
    import signal
    def _periodic():
        while True:
            time.sleep(2.0); flush()
    threading.Thread(target=_periodic, daemon=True).start()

# session 27 probe (not part of Tandem): with TANDEM_CPROF_DIR set, cProfile the round's handlers in each served process,
# one Profile per (function, batch size class, drafting or not), written every 40 calls to DIR/<fn>-<key>-<pid>.prof
CDIR = os.environ.get("TANDEM_CPROF_DIR", "")
if CDIR:
    import cProfile, functools, sys, threading, time
    os.makedirs(CDIR, exist_ok=True)
    CT = {"services.draft.server": ["DraftServicer._propose"], "services.target.server": ["TargetServicer.Verify"],
          "gateway.ending": ["Ending._commit_all"]}
    profs, calls, busy = {}, {}, [False]
    def key_of(q, a):
        req = a[1] if len(a) > 1 else None
        items = getattr(req, "items", None)
        if items is None:                       # _commit_all(self, batch, results)
            n, k = len(a[1]), 0
        else:
            n = len(items)
            k = int(any(len(getattr(it, "draft_token_ids", [])) or getattr(it, "num_draft_tokens", 0) for it in items))
        return f"{q.split('.')[-1].strip('_')}-b{'32' if n >= 16 else '1' if n <= 2 else 'mid'}-k{k}"
    def cwrap(q, fn):
        @functools.wraps(fn)
        def w(*a, **kw):
            if busy[0]:
                return fn(*a, **kw)
            try:
                key = key_of(q, a)
            except Exception:
                return fn(*a, **kw)
            p = profs.setdefault(key, cProfile.Profile())
            busy[0] = True
            try:
                p.enable()
            except ValueError:
                busy[0] = False
                return fn(*a, **kw)
            try:
                return fn(*a, **kw)
            finally:
                p.disable()
                busy[0] = False
                calls[key] = calls.get(key, 0) + 1
                if calls[key] % 40 == 0:
                    p.dump_stats(os.path.join(CDIR, f"{key}-{os.getpid()}.prof"))
        return w
    def cpoll():
        left = set(CT)
        while left:
            for m in list(left):
                mod = sys.modules.get(m)
                if mod is not None and getattr(mod, "__spec__", None) is not None:
                    ok = True
                    for q in CT[m]:
                        owner = getattr(mod, q.split(".")[0], None)
                        fn = getattr(owner, q.split(".")[1], None) if owner is not None else None
                        if fn is None:
                            ok = False
                        elif not getattr(fn, "_cprof", False):
                            w = cwrap(q, fn); w._cprof = True
                            setattr(owner, q.split(".")[1], w)
                    if ok:
                        left.discard(m)
            time.sleep(0.05)
    threading.Thread(target=cpoll, daemon=True).start()
