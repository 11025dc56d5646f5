"""Which fp8 GEMM / MoE tile parameters change a row's bits (split fixed at 1): every tile, M = 4, grouped."""
import torch, triton
from kernels import triton_fp8 as F8, triton_fp8_config as C
from kernels.fp8 import quantize_weight
from kernels.triton_fp8_moe import fused_moe_fp8_triton
torch.manual_seed(0)
dev = "cuda"
TILES = set(C.TILES)
for bm in (16, 32, 64):
    for bn in (32, 64, 128):
        for swap in (False, True):
            for fused in (False, True):
                TILES.add(C.Tile(bm, bn, 1, fused, swap, 4, 3))
TILES.add(C.Tile(16, 128, 1, False, True, 8, 3)); TILES.add(C.Tile(16, 64, 1, False, True, 2, 3))
TILES.add(C.Tile(64, 128, 1, False, False, 8, 3))
def grp(res):
    reps, g = [], {}
    for key, t in res:
        for i, r in enumerate(reps):
            if torch.equal(r, t):
                g.setdefault(i, []).append(key); break
        else:
            reps.append(t); g.setdefault(len(reps) - 1, []).append(key)
    return g
for (N, K) in [(3072, 2048), (576, 2048), (2048, 10944)]:
    w, s = quantize_weight(torch.randn(N, K, device=dev) * 0.02)
    x = torch.randn(64, K, device=dev, dtype=torch.bfloat16)
    res = []
    for t in sorted(TILES):
        for M in (4, 64):
            try:
                y = F8.gemm(x[:M], w, s, C.Config(t, 1))
            except Exception as e:
                print("fail", t, type(e).__name__); continue
            res.append(((t.block_m, t.block_n, t.kstep, "fused" if t.fused else "pre", "swap" if t.swap else "std", t.warps, t.stages, M), y[0].clone()))
    print(f"== gemm {N}x{K}")
    for i, keys in grp(res).items():
        print(f"  group {i}: " + " ".join("%dx%d/k%d/%s/%s/w%d/s%d/M%d" % k for k in keys))
E, D, I, k = 16, 2048, 1408, 6
w13 = torch.randn(E, 2 * I, D, device=dev) * 0.02; w2 = torch.randn(E, D, I, device=dev) * 0.02
q13 = [quantize_weight(w13[e]) for e in range(E)]; q2 = [quantize_weight(w2[e]) for e in range(E)]
W13, S13 = torch.stack([a for a, _ in q13]), torch.stack([b for _, b in q13])
W2, S2 = torch.stack([a for a, _ in q2]), torch.stack([b for _, b in q2])
x = torch.randn(64, D, device=dev, dtype=torch.bfloat16)
ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(64)]); wts = torch.rand(64, k, device=dev)
res = []
for bm in (16, 32, 64):
    for gu in ((32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (128, 128, 4, 3, 1), (128, 128, 8, 4, 1)):
        for dn in ((32, 128, 4, 4, 1), (64, 128, 4, 3, 1), (128, 128, 4, 3, 1), (64, 128, 4, 3, 2), (64, 128, 2, 3, 1)):
            for M in (4, 64):
                try:
                    y = fused_moe_fp8_triton(x[:M], W13, S13, W2, S2, wts[:M], ids[:M], 0, block_m=bm, tiles=(gu, dn))
                except Exception as e:
                    continue
                res.append((f"bm{bm}/gu{gu[0]}w{gu[2]}/dn{dn[0]}w{dn[2]}sp{dn[4]}/M{M}", y[0].clone()))
print("== fp8 moe")
for i, keys in grp(res).items():
    print(f"  group {i}: " + " ".join(keys))
