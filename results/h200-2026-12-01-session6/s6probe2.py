"""Session 6, probe 2: the split MLA cut's constants (SPLIT_TILES_MIN, SPLITS_MAX) swept, and the Triton router
logits against cuBLAS (padded to 128 rows / unpadded, the bf16 weight converted per call as the model does)."""
import itertools, torch, triton
import torch.nn.functional as F
from kernels import triton_mla as tm
from kernels.triton_router import logits as tri_logits

def replay_us(fn, reps=200):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(reps // 10):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps

H, R, P, BS, CAP = 16, 512, 64, 16, 4096
SHAPES = [(1, 1, 300), (1, 1, 1000), (1, 4, 1000), (1, 1, 4000), (1, 4, 4000), (8, 4, 1000), (8, 4, 4000),
          (32, 1, 1000), (32, 4, 1000), (32, 1, 4000), (32, 4, 4000)]
COMBOS = [(1, 32), (1, 64), (2, 32), (2, 16), (4, 32), (4, 16), (8, 16)]
print("| requests | rows each | keys | old rule us | " + " | ".join(f"min {a} max {b}" for a, b in COMBOS) + " | KV floor us |")
print("|---" * (5 + len(COMBOS)) + "|")
for B, rows, L in SHAPES:
    nb = CAP // BS
    ckv = torch.randn(B * nb, BS, R, device="cuda", dtype=torch.bfloat16)
    kpe = torch.randn(B * nb, BS, P, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(B * nb, device="cuda", dtype=torch.int32).view(B, nb)
    N = B * rows
    req = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    pos = (L - rows + torch.arange(rows, device="cuda", dtype=torch.int32)).repeat(B)
    clen = torch.full((B,), L, device="cuda", dtype=torch.int32)
    ql = torch.randn(N, H, R, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(N, H, P, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(ql)
    old = max(1, min(64, triton.cdiv(2 * 132, N), triton.cdiv(CAP, 2 * 64)))
    cells = [replay_us(lambda: tm.mla_attention_triton(ql, qp, ckv, kpe, tables, req, pos, clen, 0.1, out=out, splits=old))]
    for mn, mx in COMBOS:
        tm.SPLIT_TILES_MIN, tm.SPLITS_MAX = mn, mx
        cells.append(replay_us(lambda: tm.mla_attention_triton(ql, qp, ckv, kpe, tables, req, pos, clen, 0.1, out=out)))
    floor = B * L * (R + P) * 2 / 4.2e12 * 1e6
    print(f"| {B} | {rows} | {L} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {floor:.1f} |", flush=True)
tm.SPLIT_TILES_MIN, tm.SPLITS_MAX = 4, 32

print("\n| router E x D | rows | Triton us | cuBLAS padded to 128 us | cuBLAS unpadded us | weight floor us |\n|---|---|---|---|---|---|")
for E, D in [(64, 2048), (256, 7168)]:
    w = (torch.randn(E, D, device="cuda") * 0.02).bfloat16()
    for n in (1, 4, 16, 32, 128, 256, 512):
        x = torch.randn(n, D, device="cuda").bfloat16()
        pad = torch.empty(max(n, 128), D, device="cuda")
        def padded():
            pad[:n].copy_(x)
            return F.linear(pad, w.float())[:n]
        t_tri = replay_us(lambda: tri_logits(x, w))
        t_pad = replay_us(padded)
        t_raw = replay_us(lambda: F.linear(x.float(), w.float()))
        ok = torch.equal(tri_logits(x[:1], w)[0], tri_logits(x, w)[0])
        print(f"| {E} x {D} | {n} | {t_tri:.1f} | {t_pad:.1f} | {t_raw:.1f} | {E * D * 2 / 4.2e12 * 1e6:.1f} |"
              + ("" if ok else " ROW BITS DIFFER"), flush=True)
