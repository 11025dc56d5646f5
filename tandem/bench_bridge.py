"""`tandem bench bridge`: the hidden-row bridge (services/bridge/channel.py) against bare torch.distributed.

Two processes, target side on cuda:0 and draft side on cuda:1 (NCCL), both on cuda:0 (CUDA IPC, `--device
cuda` with one GPU), or both on the CPU (gloo, or with `--transport shm` the shared-memory ring). For each batch B
a transfer is B x (K+1) rows x hidden (bf16), what one round moves:
  bridge: NCCL / gloo: from the target's RowChannel.send(transfer_id) to the draft's take returning the rows,
          which the target pushed meanwhile (services/bridge/push.py: the header through the store, the payload
          by p2p, received by the draft's drain thread); the rings (IPC, shm): the draft's take wall time, the
          copy out of the slot the target pushed, its copy already done;
  take:   NCCL / gloo: the draft's take of a transfer that landed already (what a Propose pays when its rows
          arrived before it);
  check:  rings only: the finiteness check (services/bridge/rows.check_finite) run after the take, a second
          sync; checked take: the take as the draft's Propose runs it, the check's reduction enqueued before
          the take's one sync (RowChannel.take with a field);
  bare:   NCCL / gloo: rank 0's dist.send of the same bytes on a plain process group, from the send to rank 1's
          dist.recv returning them (synchronized; one way, as the bridge figure: one clock on one host); rings:
          the draft's own copy of the bytes on its device, synchronized (NCCL refuses two ranks on one GPU).
Medians after --warmup transfers.
"""
from __future__ import annotations

import argparse
import queue
import statistics
import time

from infra.defaults import NUM_SPECULATIVE_TOKENS
from tandem.bench import write_results


RINGS = ("ipc", "shm")                   # transports the target pushes into (no pulls): timed by _ring_worker


def _tid(b: int, i: int) -> int:
    return b * 100_000 + i + 1


def _wait_ready(ch, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ch.ready:
        if ch.error or time.monotonic() > deadline:
            raise RuntimeError(f"bridge did not connect: {ch.error or 'timeout'}")
        time.sleep(0.01)


def _worker(rank: int, cfg: dict, barrier, stamp, results) -> None:
    import torch
    import torch.distributed as dist
    from services.bridge.channel import RowChannel
    cuda, ring = cfg["device"] == "cuda", cfg["transport"] in RINGS
    dev = "cuda:0" if cfg["transport"] == "ipc" else f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(dev)
    backend, dtype = cfg["transport"], getattr(torch, cfg["dtype"])
    n, warm = cfg["warmup"] + cfg["iters"], cfg["warmup"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = {b: (b * (cfg["k"] + 1), cfg["hidden"]) for b in cfg["batches"]}
    ch = RowChannel(cfg["addr"], "sender" if rank == 0 else "receiver", backend, dev, hello={"bench": "bridge"})
    _wait_ready(ch)
    out: dict[str, dict] = {"bridge": {}, "bare": {}, "check": {}, "served": {}, "take": {}}
    if ring:
        _ring_worker(rank, ch, shapes, n, warm, dtype, dev, sync, barrier, out)
        results.put((rank, out))
        return
    for b, shape in shapes.items():
        rows = torch.randn(shape, device=dev).to(dtype)
        pushed, taken = [], []
        for i in range(n):
            barrier.wait()
            if rank == 0:
                sync()
                stamp.value = time.perf_counter()
                ch.send(_tid(b, 2 * i), rows)
                ch.send(_tid(b, 2 * i + 1), rows)             # lands while the draft takes the first
            else:
                got = ch.take(_tid(b, 2 * i), 60.0)           # waits for the push to land
                pushed.append(time.perf_counter() - stamp.value)
                time.sleep(0.005)
                t0 = time.perf_counter()
                ch.take(_tid(b, 2 * i + 1), 60.0)
                taken.append(time.perf_counter() - t0)
                assert tuple(got.shape) == shape, (got.shape, shape)
            barrier.wait()
        if rank == 1:
            out["bridge"][b], out["take"][b] = statistics.median(pushed[warm:]), statistics.median(taken[warm:])
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{cfg['port2']}", rank=rank, world_size=2)
    for b, (rows, hidden) in shapes.items():
        payload = torch.empty(rows, hidden * torch.finfo(dtype).bits // 8, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(n):
            barrier.wait()
            if rank == 0:
                sync()
                stamp.value = time.perf_counter()
                dist.send(payload, 1)
            else:
                dist.recv(payload, 0)
                sync()
                times.append(time.perf_counter() - stamp.value)
            barrier.wait()
        if rank == 1:
            out["bare"][b] = statistics.median(times[warm:])
    dist.destroy_process_group()
    results.put((rank, out))


def _ring_worker(rank: int, ch, shapes: dict, n: int, warm: int, dtype, dev: str, sync, barrier, out: dict) -> None:
    """A ring (IPC, shm): the target pushes a transfer and waits for its copy, then the draft takes it (a ring holds
    a few transfers, so they alternate); the draft also times its check and a bare copy of the same bytes."""
    import torch
    from services.bridge.rows import check_finite
    for b, shape in shapes.items():
        rows = torch.randn(shape, generator=torch.Generator().manual_seed(b)).to(dtype).to(dev)   # alike on both
        took, checked, served, bare = [], [], [], []
        for i in range(n):
            if rank == 0:
                ch.send(_tid(b, i), rows)
                sync()
                barrier.wait()
                barrier.wait()
                continue
            barrier.wait()
            t0 = time.perf_counter()
            got = ch.take(_tid(b, i), 60.0)
            t1 = time.perf_counter()
            check_finite(got, "bench")
            t2 = time.perf_counter()
            ch.take(_tid(b, i), 60.0, "bench")                 # again, checked as the draft takes: one sync
            took.append(t1 - t0)
            checked.append(t2 - t1)
            served.append(time.perf_counter() - t2)
            assert tuple(got.shape) == shape and torch.equal(got, rows), (got.shape, shape)
            dst = torch.empty_like(rows)
            sync()
            t0 = time.perf_counter()
            dst.copy_(rows)
            sync()
            bare.append(time.perf_counter() - t0)
            barrier.wait()
        if rank == 1:
            for key, ts in (("bridge", took), ("check", checked), ("served", served), ("bare", bare)):
                out[key][b] = statistics.median(ts[warm:])


def run(device: str, batches: list[int], k: int, hidden: int, dtype: str, warmup: int, iters: int,
        transport: str = "auto") -> list[dict]:
    import multiprocessing as mp

    import torch
    from infra.ports import free_ports
    ctx = mp.get_context("spawn")
    port, port2 = free_ports(2)
    if transport == "auto":
        transport = "gloo" if device == "cpu" else "nccl" if torch.cuda.device_count() >= 2 else "ipc"
    cfg = dict(device=device, transport=transport, batches=batches, k=k, hidden=hidden, dtype=dtype, warmup=warmup,
               iters=iters, addr=f"127.0.0.1:{port}", port2=port2)
    barrier, results, stamp = ctx.Barrier(2), ctx.Queue(), ctx.Value("d", 0.0)   # perf_counter: one clock a host
    procs = [ctx.Process(target=_worker, args=(r, cfg, barrier, stamp, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 600
    try:
        while len(got) < len(procs):
            try:
                rank, out = results.get(timeout=1.0)
                got[rank] = out
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead or time.monotonic() > deadline:     # a worker failed (its traceback is on stderr)
                    raise RuntimeError(f"bench bridge: worker {dead or 'timeout'} failed") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    rows = []
    for b in batches:
        nbytes = b * (k + 1) * hidden * elem
        bridge, bare = got[1]["bridge"][b], got[1]["bare"][b]
        rows.append({"transport": transport, "batch": b, "rows": b * (k + 1), "bytes": nbytes,
                     "bridge_us": 1e6 * bridge, "check_us": 1e6 * got[1]["check"].get(b, float("nan")),
                     "checked_take_us": 1e6 * got[1]["served"].get(b, float("nan")),
                     "landed_take_us": 1e6 * got[1]["take"].get(b, float("nan")),
                     "bare_us": 1e6 * bare, "ratio": bridge / bare, "bridge_gb_s": nbytes / bridge / 1e9})
    return rows


def table(rows: list[dict]) -> str:
    ipc = rows and rows[0]["transport"] in RINGS
    bare = "bare copy, synchronized µs" if ipc else "bare send, one way µs"
    bridge = "bridge take µs" if ipc else "bridge: send to rows at the draft µs"
    lines = [f"| batch | rows (B x (K+1)) | bytes | {bridge} | {bare} | bridge / bare | bridge GB/s"
             + (" | check after the take µs | checked take (one sync) µs |" if ipc else " | take of landed rows µs |"),
             "|---|---|---|---|---|---|---|" + ("---|---|" if ipc else "---|")]
    lines += [f"| {r['batch']} | {r['rows']} | {r['bytes']} | {r['bridge_us']:.1f} | {r['bare_us']:.1f} | "
              f"{r['ratio']:.2f} | {r['bridge_gb_s']:.2f} |"
              + (f" {r['check_us']:.1f} | {r['checked_take_us']:.1f} |" if ipc else f" {r['landed_take_us']:.1f} |")
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench bridge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (NCCL, cuda:0 -> cuda:1) | cpu (gloo)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("-k", type=int, default=NUM_SPECULATIVE_TOKENS, help="draft tokens per round: K+1 rows per request")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--transport", default="auto", choices=["auto", "gloo", "shm"],
                   help="auto: NCCL (two GPUs), CUDA IPC (one), gloo (cpu); shm: the CPU's shared-memory ring")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="results/bridge")
    a = p.parse_args(argv)
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("tandem bench bridge: --device cuda without a GPU; skipped (`--device cpu` runs it over gloo)")
            return 0
    if a.transport != "auto" and a.device != "cpu":
        p.error(f"--transport {a.transport} is a CPU transport; --device is {a.device}")
    rows = run(a.device, [int(x) for x in a.batches.split(",")], a.k, a.hidden, a.dtype, a.warmup, a.iters,
               a.transport)
    where = {"nccl": "NCCL cuda:0 -> cuda:1", "ipc": "CUDA IPC, one GPU", "gloo": "gloo, cpu",
             "shm": "shared-memory ring, cpu"}[rows[0]["transport"]]
    md = (f"Hidden-row bridge vs a bare transfer ({where}"
          f"), hidden {a.hidden} {a.dtype}, K = {a.k}, medians of {a.iters} after {a.warmup}, "
          f"{time.strftime('%Y-%m-%d')}\n`tandem bench bridge {' '.join(argv or [])}`\n\n" + table(rows) + "\n")
    write_results(a.out, "bridge", md, rows)
    return 0
