"""`tandem bench bridge`: the hidden-row bridge (services/bridge/channel.py) against bare torch.distributed.

Two processes, target side on cuda:0 and draft side on cuda:1 (NCCL), or both on the CPU (gloo,
`--device cpu`). For each batch B a transfer is B x (K+1) rows x hidden (bf16), what one round moves:
  bridge: the draft's RowChannel.take(transfer_id) wall time (a pull through the store, the target's
          ack, a header and the payload on the channel's stream), the rows parked by send() before;
  bare:   rank 0's dist.send of the same bytes followed by a 4-byte dist.recv acknowledgement
          (one round trip, synchronized), on a plain process group.
Medians after --warmup transfers. Needs two GPUs for NCCL: with fewer it says so and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import time

from infra.defaults import NUM_SPECULATIVE_TOKENS
from tandem.bench import write_results


def _tid(b: int, i: int) -> int:
    return b * 100_000 + i + 1


def _wait_ready(ch, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ch.ready:
        if ch.error or time.monotonic() > deadline:
            raise RuntimeError(f"bridge did not connect: {ch.error or 'timeout'}")
        time.sleep(0.01)


def _worker(rank: int, cfg: dict, barrier, results) -> None:
    import torch
    import torch.distributed as dist
    from services.bridge.channel import RowChannel
    cuda = cfg["device"] == "cuda"
    dev = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(dev)
    backend, dtype = ("nccl" if cuda else "gloo"), getattr(torch, cfg["dtype"])
    n, warm = cfg["warmup"] + cfg["iters"], cfg["warmup"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = {b: (b * (cfg["k"] + 1), cfg["hidden"]) for b in cfg["batches"]}
    ch = RowChannel(cfg["addr"], "sender" if rank == 0 else "receiver", backend, dev, hello={"bench": "bridge"})
    _wait_ready(ch)
    out: dict[str, dict] = {"bridge": {}, "bare": {}}
    if rank == 0:
        for b, shape in shapes.items():                       # park every transfer before the pulls
            rows = torch.randn(shape, device=dev).to(dtype)
            for i in range(n):
                ch.send(_tid(b, i), rows)
        sync()
        barrier.wait()
        barrier.wait()                                         # the receiver has pulled them all
    else:
        barrier.wait()
        for b, shape in shapes.items():
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                rows = ch.take(_tid(b, i), 60.0)               # synchronizes the channel's stream
                times.append(time.perf_counter() - t0)
                assert tuple(rows.shape) == shape, (rows.shape, shape)
            out["bridge"][b] = statistics.median(times[warm:])
        barrier.wait()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{cfg['port2']}", rank=rank, world_size=2)
    ack = torch.zeros(4, dtype=torch.uint8, device=dev)
    for b, (rows, hidden) in shapes.items():
        payload = torch.empty(rows, hidden * torch.finfo(dtype).bits // 8, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(payload, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(payload, 0)
                dist.send(ack, 0)
            sync()
            times.append(time.perf_counter() - t0)
        out["bare"][b] = statistics.median(times[warm:])
    dist.destroy_process_group()
    results.put((rank, out))


def run(device: str, batches: list[int], k: int, hidden: int, dtype: str, warmup: int, iters: int) -> list[dict]:
    import multiprocessing as mp
    from infra.ports import free_ports
    ctx = mp.get_context("spawn")
    port, port2 = free_ports(2)
    cfg = dict(device=device, batches=batches, k=k, hidden=hidden, dtype=dtype, warmup=warmup, iters=iters,
               addr=f"127.0.0.1:{port}", port2=port2)
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cfg, barrier, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=600)
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    import torch
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    rows = []
    for b in batches:
        nbytes = b * (k + 1) * hidden * elem
        bridge, bare = got[1]["bridge"][b], got[0]["bare"][b]
        rows.append({"batch": b, "rows": b * (k + 1), "bytes": nbytes, "bridge_us": 1e6 * bridge,
                     "bare_us": 1e6 * bare, "ratio": bridge / bare, "bridge_gb_s": nbytes / bridge / 1e9})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| batch | rows (B x (K+1)) | bytes | bridge take µs | bare send + ack µs | bridge / bare | bridge GB/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['rows']} | {r['bytes']} | {r['bridge_us']:.1f} | {r['bare_us']:.1f} | "
              f"{r['ratio']:.2f} | {r['bridge_gb_s']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench bridge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (NCCL, cuda:0 -> cuda:1) | cpu (gloo)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("-k", type=int, default=NUM_SPECULATIVE_TOKENS, help="draft tokens per round: K+1 rows per request")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="results/bridge")
    a = p.parse_args(argv)
    if a.device == "cuda":
        import torch
        if torch.cuda.device_count() < 2:
            print(f"tandem bench bridge: needs 2 GPUs for NCCL between cuda:0 and cuda:1, found "
                  f"{torch.cuda.device_count()}; skipped (`--device cpu` runs it over gloo)")
            return 0
    rows = run(a.device, [int(x) for x in a.batches.split(",")], a.k, a.hidden, a.dtype, a.warmup, a.iters)
    md = (f"Hidden-row bridge vs bare torch.distributed ({'NCCL cuda:0 -> cuda:1' if a.device == 'cuda' else 'gloo, cpu'}"
          f"), hidden {a.hidden} {a.dtype}, K = {a.k}, medians of {a.iters} after {a.warmup}, "
          f"{time.strftime('%Y-%m-%d')}\n`tandem bench bridge {' '.join(argv or [])}`\n\n" + table(rows) + "\n")
    write_results(a.out, "bridge", md, rows)
    return 0
