"""Session 6 probe: the split MLA kernel's new cut (from a row's length) vs the old (from the launch's rows), and
the router's 128-row class vs unpadded, as CUDA-graph replays on the H200."""
import torch, triton
import torch.nn.functional as F
from kernels.triton_mla import mla_attention_triton, num_splits
from models.moe import router_logits

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

H, R, P, BS, CAP = 16, 512, 64, 16, 4096   # V2-Lite heads / latent / rope; block size; graph table 4096 keys
print("| requests | rows each | keys a request | old splits | new splits | old us | new us | KV floor us |")
print("|---|---|---|---|---|---|---|---|")
for B, rows, L in [(1, 1, 1000), (1, 4, 1000), (1, 1, 4000), (1, 4, 4000), (8, 4, 4000), (32, 1, 1000),
                   (32, 4, 1000), (32, 1, 4000), (32, 4, 4000)]:
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
    new = num_splits(CAP, 64)
    t_old = replay_us(lambda: mla_attention_triton(ql, qp, ckv, kpe, tables, req, pos, clen, 0.1, out=out, splits=old))
    ref = out.clone()
    t_new = replay_us(lambda: mla_attention_triton(ql, qp, ckv, kpe, tables, req, pos, clen, 0.1, out=out))
    assert (out.float() - ref.float()).abs().max() < 2e-2 * ref.float().abs().max()
    floor = B * L * (R + P) * 2 / 4.2e12 * 1e6
    print(f"| {B} | {rows} | {L} | {old} | {new} | {t_old:.1f} | {t_new:.1f} | {floor:.1f} |", flush=True)

print("\n| router E x D | rows | padded to 128 us | unpadded us |\n|---|---|---|---|")
for E, D in [(64, 2048), (256, 7168)]:
    w = (torch.randn(E, D, device="cuda") * 0.02).bfloat16()
    for n in (1, 4, 16, 32, 128):
        x = torch.randn(n, D, device="cuda").bfloat16()
        wf = w.float()
        t_pad = replay_us(lambda: router_logits(x, w))
        t_raw = replay_us(lambda: F.linear(x.float(), wf))
        print(f"| {E} x {D} | {n} | {t_pad:.1f} | {t_raw:.1f} |", flush=True)
