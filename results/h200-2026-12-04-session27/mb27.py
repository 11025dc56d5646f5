# session 27 (run next session on one H200): where the draft's CUDA IPC take and the step layout spend their host time.
# Part 1: a sender process pushes [R, 2048] bf16 rows into an IpcSender ring; this process takes them, each step of
# IpcReceiver.take / RowChannel._take timed on the host (median us over N), and variants: a preallocated pinned flag,
# no clone (the slot read in place), the read event recorded on the compute stream. Part 2: PagedKVCache.prepare on
# the GPU at batch 1 / 32, 1 / 4 tokens each, in parts (the host layout alone, the pageable upload, the casts).
import multiprocessing as mp, statistics, sys, time, json
import torch

N = 300


def sender(conn, rows_n):
    from services.bridge.ipc import IpcSender
    from services.bridge.rows import DTYPE_TO_PB
    dev = torch.device("cuda", 0)
    s = IpcSender(dev)
    conn.send(s.spec())
    s.attach(conn.recv())
    stream = torch.cuda.Stream(dev)
    rows = {r: torch.randn(r, 2048, device=dev, dtype=torch.bfloat16) for r in rows_n}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        tid, r = msg
        stream.wait_stream(torch.cuda.current_stream(dev))
        s.push(tid, rows[r], DTYPE_TO_PB[torch.bfloat16], stream)
        conn.send("pushed")
    s.close()


def med(xs):
    return round(1e6 * statistics.median(xs), 1)


def part1(out):
    from services.bridge.ipc import IpcReceiver
    dev = torch.device("cuda", 0)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=sender, args=(b, (4, 128)), daemon=True)
    p.start()
    rcv = IpcReceiver(dev, a.recv())
    a.send(rcv.answer())
    chan = torch.cuda.Stream(dev)
    comp = torch.cuda.current_stream(dev)
    pinned = torch.empty((), dtype=torch.bool, pin_memory=True)
    tid = 0
    for R in (4, 128):
        for variant in ("as-is", "pinned-flag", "no-clone", "read-on-compute"):
            t = {k: [] for k in ("wait", "wait_event", "enter", "clone", "record", "flag_alloc", "flag_ops",
                                 "exit", "wait_stream", "record_stream", "use", "total", "sync")}
            for i in range(N + 20):
                tid += 1
                a.send((tid, R)); assert a.recv() == "pushed"
                slot = tid % rcv.slots
                c0 = time.perf_counter()
                hdr = rcv.headers.wait(slot, tid, 1.0); c1 = time.perf_counter()
                n_rows, row_bytes, code = hdr
                chan.wait_event(rcv.written[slot]); c2 = time.perf_counter()
                cm = torch.cuda.stream(chan); cm.__enter__(); c3 = time.perf_counter()
                start = slot * rcv.slot_bytes
                view = rcv.buf[start:start + n_rows * row_bytes].view(n_rows, row_bytes)
                out = view if variant == "no-clone" else view.clone(); c4 = time.perf_counter()
                if variant != "read-on-compute" and variant != "no-clone":
                    rcv.read[slot].record(chan)
                c5 = time.perf_counter()
                flag = pinned if variant == "pinned-flag" else torch.empty((), dtype=torch.bool, pin_memory=True)
                c6 = time.perf_counter()
                typed = out.view(torch.bfloat16).reshape(n_rows, row_bytes // 2)
                flag.copy_(torch.isfinite(typed.sum(dtype=torch.float32)), non_blocking=True); c7 = time.perf_counter()
                cm.__exit__(None, None, None); c8 = time.perf_counter()
                comp.wait_stream(chan); c9 = time.perf_counter()
                out.record_stream(comp); c10 = time.perf_counter()
                y = typed[-1:].float() * 2                                   # the use: one op on the compute stream
                if variant in ("read-on-compute", "no-clone"):
                    rcv.read[slot].record(comp)
                c11 = time.perf_counter()
                comp.synchronize(); c12 = time.perf_counter()
                assert bool(flag) and rcv.headers.tid(slot) == tid
                if i >= 20:
                    for k, (x0, x1) in zip(t, [(c0, c1), (c1, c2), (c2, c3), (c3, c4), (c4, c5), (c5, c6), (c6, c7),
                                               (c7, c8), (c8, c9), (c9, c10), (c10, c11), (c1, c11), (c11, c12)]):
                        t[k].append(x1 - x0)
            row = {k: med(v) for k, v in t.items()}
            out[f"take R={R} {variant}"] = row
            print(f"take R={R:3d} {variant:16s}", json.dumps(row), flush=True)
    # the draft's take as served since f76a187: take_in_place on the compute stream, the flag queued, landed's sync,
    # release (the read event) after the use
    from services.bridge.rows import finite_flag
    for R in (4, 128):
        t = {k: [] for k in ("take_in_place", "flag", "use", "sync", "release", "total")}
        for i in range(N + 20):
            tid += 1
            a.send((tid, R)); assert a.recv() == "pushed"
            c0 = time.perf_counter()
            rows, code, whole, release = rcv.take_in_place(tid, comp, 1.0); c1 = time.perf_counter()
            typed = rows.view(torch.bfloat16).reshape(rows.shape[0], rows.shape[1] // 2)
            flag = finite_flag(typed); c2 = time.perf_counter()
            y = typed[-1:].float() * 2; c3 = time.perf_counter()
            comp.synchronize(); c4 = time.perf_counter()
            assert whole() and bool(flag)
            release(); c5 = time.perf_counter()
            if i >= 20:
                for k, d in zip(t, (c1 - c0, c2 - c1, c3 - c2, c4 - c3, c5 - c4, (c2 - c0) + (c5 - c4))):
                    t[k].append(d)
        row = {k: med(v) for k, v in t.items()}
        out[f"take_in_place R={R}"] = row
        print(f"take R={R:3d} in place (served)", json.dumps(row), flush=True)
    a.send(None); p.join(10)


def part2(out):
    from models.kv_cache import PagedKVCache
    from models.batch import Stage, lay_out
    dev = torch.device("cuda", 0)
    c = PagedKVCache(2, 4096, 16, 512, 64, dtype=torch.bfloat16, device=dev)
    stages = {}
    c.staging = lambda B, N, w: stages.setdefault((B, N), Stage.new(N, B, 129, 0, dev))
    for B in (1, 32):
        ids = [f"r{B}-{i}" for i in range(B)]
        for r in ids:
            c.allocate(r); c.extend(r, 150)
        for q in (1, 4):
            tt, tl, tu = [], [], []
            for it in range(N):
                for r in ids:
                    c.rollback(r, q)
                t0 = time.perf_counter(); c.prepare(ids, [q] * B, [5] * (q * B)); t1 = time.perf_counter()
                tt.append(t1 - t0)
                tables = [c._tables[r] for r in ids]; starts = [c._lengths[r] - q for r in ids]
                t0 = time.perf_counter(); lay_out(ids, tables, starts, [q] * B, 16, "cpu", [5] * (q * B)); t1 = time.perf_counter()
                tl.append(t1 - t0)
                host = torch.zeros(4096, dtype=torch.long)
                t0 = time.perf_counter(); host.to(dev, non_blocking=True); t1 = time.perf_counter()
                tu.append(t1 - t0)
            torch.cuda.synchronize()
            row = {"prepare": med(tt), "layout on the host alone": med(tl), "one pageable 32 KB upload": med(tu)}
            out[f"prepare B={B} q={q}"] = row
            print(f"prepare B={B:2d} q={q}", json.dumps(row), flush=True)


if __name__ == "__main__":
    out = {}
    for part in (part1, part2):
        try:
            part(out)
        except Exception as e:
            import traceback; traceback.print_exc()
            out[part.__name__] = f"failed: {type(e).__name__}: {e}"
    json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "mb27.json", "w"), indent=1)
