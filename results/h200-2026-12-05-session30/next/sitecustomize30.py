# session 30 probe (not part of Tandem): TANDEM_PHASES_DIR set -> each process logs (name, start, end, thread) per
# call on CLOCK_MONOTONIC. TANDEM_ALTERNATE_ORDER=1: the target's RowChannel.pushes answers False every other time it
# is read (once a Verify with `ahead`): those rounds push the rows into the ring BEFORE the next Propose, the others after
import os
DIR = os.environ.get("TANDEM_PHASES_DIR", "")
if DIR:
    import atexit, functools, inspect, json, sys, threading, time
    TARGETS = {
        "services.draft.server": ["DraftServicer._propose", "DraftServicer._gather_rows", "DraftServicer.Propose", "DraftServicer._item"],
        "services.draft.engine": ["DraftEngine.propose", "DraftEngine.expected_rows"],
        "services.bridge.channel": ["RowChannel.take_later", "RowChannel.send", "RowChannel._take"],
        "services.bridge.shm": ["ShmSender.push", "ShmReceiver.take"],
        "services.bridge.ipc": ["SlotHeaders.wait", "IpcSender.push", "IpcReceiver.take_in_place"],
        "services.lane": ["LaneServer._answer"],
        "services.target.server": ["TargetServicer.Verify", "TargetServicer._describe"],
        "services.target.engine": ["TargetEngine.verify"],
        "services.target.ahead": ["AheadSender.send"],
        "gateway.scheduler": ["Scheduler._round"],
        "gateway.proposals": ["collect", "after_verify", "plan_ahead"],
        "gateway.ending": ["Ending._commit_all"],
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
        if mod.__name__ == "services.bridge.channel" and os.environ.get("TANDEM_ALTERNATE_ORDER") == "1":
            cls = getattr(mod, "RowChannel", None)
            if cls is not None and not getattr(cls, "_alternating", False):
                orig, flip = cls.pushes, [False]
                def pushes(self):
                    flip[0] = not flip[0]
                    return orig.fget(self) and flip[0]
                cls.pushes, cls._alternating = property(pushes), True
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
    def _periodic():
        while True:
            time.sleep(1.0); flush()
    threading.Thread(target=_periodic, daemon=True).start()
