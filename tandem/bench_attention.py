"""`tandem bench attention`: the paged MLA decode / verify attention, its key splits merged in a second launch
against merged in the attention launch (kernels/triton_mla.py with counters), side by side in one run.

Per (heads, rows, keys a row): rows / 4 requests of 4 verify rows each (1 row: one decode request), each request's
keys on random pages of a block-16 cache whose table holds --table-keys keys (it fixes the split rule, as the
served table width does); R 512, P 64, bf16 on a GPU. Time per call: a CUDA graph of 4 calls over 4 rotated page
sets (so keys come from HBM, not L2), median of 5 replays (tandem/bench_fp8.device_time). Bits: the merged output against the two-launch
one (max |difference|; 0 is the same bits) and the counters back at zero. Floor: the latent keys each request
reads (keys x (R + P) x 2 bytes) at 4.23 TB/s. On the CPU (TRITON_INTERPRET=1, tests) the kernels are interpreted:
the bits are checked, the times say nothing.
"""
from __future__ import annotations

import argparse

import torch

from tandem.bench import write_results
from tandem.bench_fp8 import FLOOR_BW, cycle, device_time

R, P, BS, SETS = 512, 64, 16, 4


def case(heads: int, rows: int, keys: int, table_keys: int, device: str, dtype):
    """-> (args of mla_attention_triton for each of SETS page sets, the latent bytes one call reads)."""
    per = 4 if rows >= 4 else 1                              # verify rows a request (decode: 1)
    B, blocks = rows // per, -(-keys // BS)
    g = torch.Generator(device=device).manual_seed(heads * 131 + rows * 17 + keys)
    pages = SETS * B * blocks
    ckv = torch.randn(pages + 1, BS, R, device=device, generator=g).to(dtype)
    kpe = torch.randn(pages + 1, BS, P, device=device, generator=g).to(dtype)
    perm = torch.randperm(pages, device=device, generator=g).int() + 1
    req = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(per)
    pos = (keys - per + torch.arange(per, device=device)).repeat(B).long()
    clen = torch.full((B,), keys, dtype=torch.int32, device=device)
    ql = torch.randn(rows, heads, R, device=device, generator=g).to(dtype)
    qp = torch.randn(rows, heads, P, device=device, generator=g).to(dtype)
    sets = []
    for s in range(SETS):
        table = torch.zeros(B, table_keys // BS, dtype=torch.int32, device=device)
        table[:, :blocks] = perm[s * B * blocks:(s + 1) * B * blocks].view(B, blocks)
        sets.append((ql, qp, ckv, kpe, table, req, pos, clen, 0.1))
    return sets, B * keys * (R + P) * ckv.element_size()


def measure(heads: int, rows: int, keys: int, a) -> dict:
    from kernels.dispatch import use_triton_forced
    from kernels.triton_mla import mla_attention_triton
    use_triton_forced(torch.empty(0, device=a.device))          # CPU: TRITON_INTERPRET=1, or a clear error
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    sets, nbytes = case(heads, rows, keys, a.table_keys, a.device, dtype)
    arrivals = torch.zeros(1 << 15, dtype=torch.int32, device=a.device)
    two_0 = mla_attention_triton(*sets[0]).float()
    mla_attention_triton(*sets[1], arrivals=arrivals)         # the workspace now holds another set's partial sums
    out = torch.full((rows, heads, R), float("nan"), dtype=dtype, device=a.device)   # rows left unwritten show
    mla_attention_triton(*sets[0], out=out, arrivals=arrivals)
    diff, zero = float((out.float() - two_0).abs().max()), not bool(arrivals.any())
    two, merged = (1e6 * device_time(cycle(lambda args: mla_attention_triton(*args, out=out, arrivals=c), sets),
                                     a.device, SETS) for c in (None, arrivals))
    return {"heads": heads, "rows": rows, "keys": keys, "two_launches_us": two, "merged_us": merged,
            "merged_over_two": merged / two, "floor_us": 1e6 * nbytes / FLOOR_BW,
            "max_abs_difference": diff, "counters_zero": zero and not bool(arrivals.any())}


def table(rows: list[dict], device: str) -> str:
    lines = [f"Paged MLA attention per call on {device}: key splits merged in a second launch vs in the attention "
             "launch (R 512, P 64, block 16).", "",
             "| heads | rows | keys a row | two launches µs | merged µs | merged / two | KV floor µs | "
             "merged / floor | max abs difference | counters zero |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['heads']} | {r['rows']} | {r['keys']} | {r['two_launches_us']:.1f} | {r['merged_us']:.1f} | "
              f"{r['merged_over_two']:.2f} | {r['floor_us']:.2f} | {r['merged_us'] / r['floor_us']:.1f} | "
              f"{r['max_abs_difference']:.1e} | {r['counters_zero']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--heads", default="16,128", help="16: DeepSeek-V2-Lite's, 128: V3's")
    p.add_argument("--rows", default="1,4,32,128", help="query rows a call (4 a request from 4 up)")
    p.add_argument("--keys", default="64,256,1024,4096", help="keys each request holds")
    p.add_argument("--table-keys", type=int, default=4096, help="keys a block table holds (the split rule's)")
    p.add_argument("--out", default="results/attention")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]
    if max(ints(a.keys)) > a.table_keys:
        p.error(f"--keys {a.keys}: a request holds at most --table-keys {a.table_keys} keys")
    rows = []
    for heads in ints(a.heads):
        for n in ints(a.rows):
            for keys in ints(a.keys):
                rows.append(measure(heads, n, keys, a))
                print(f"heads {heads} rows {n} keys {keys}: {rows[-1]['two_launches_us']:.1f} -> "
                      f"{rows[-1]['merged_us']:.1f} µs", flush=True)
    write_results(a.out, "attention", table(rows, a.device), rows)
    return 0
