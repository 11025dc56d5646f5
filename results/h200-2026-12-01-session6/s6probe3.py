"""Session 6, probe 3: the one-row Triton router logits kernel's tiles against cuBLAS (padded to 128 rows, the
bf16 weight converted per call as models/moe.py does), with the row-bit check."""
import torch
import torch.nn.functional as F
from kernels.triton_router import logits as tri_logits
import importlib.util, sys
spec = importlib.util.spec_from_file_location("p2", ".gpu/s6probe2.py")
src = open(".gpu/s6probe2.py").read().split("H, R, P, BS, CAP")[0]
exec(src)                                     # replay_us
TILES = [(4, 1024), (8, 512), (2, 1024), (4, 512), (2, 2048), (1, 2048), (8, 256)]
print("| router E x D | rows | " + " | ".join(f"Triton {a}x{b} us" for a, b in TILES) + " | cuBLAS padded to 128 us |")
print("|---" * (3 + len(TILES)) + "|")
for E, D in [(64, 2048), (256, 7168)]:
    w = (torch.randn(E, D, device="cuda") * 0.02).bfloat16()
    for n in (1, 4, 16, 32, 128):
        x = torch.randn(n, D, device="cuda").bfloat16()
        pad = torch.empty(128, D, device="cuda")
        def padded():
            pad[:n].copy_(x)
            return F.linear(pad, w.float())[:n]
        cells, bad = [], []
        ref = F.linear(x.float(), w.float())
        for t in TILES:
            cells.append(replay_us(lambda: tri_logits(x, w, t)))
            full = tri_logits(x, w, t)
            if not torch.equal(tri_logits(x[-1:], w, t)[0], full[-1]) or (full - ref).abs().max() > 1e-5 * ref.abs().max():
                bad.append(t)
        print(f"| {E} x {D} | {n} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {replay_us(padded):.1f} |"
              + (f" BAD {bad}" if bad else ""), flush=True)
