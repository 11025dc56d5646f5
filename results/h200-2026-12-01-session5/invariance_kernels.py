"""Which kernel parameters change a row's bits: token 0's output across row counts and configs, grouped."""
import itertools, torch
from kernels import triton_fp8 as F8, triton_fp8_config as C, moe_tiles as MT
from kernels.fp8 import quantize_weight
from kernels.triton_fp8_moe import fused_moe_fp8_triton
from kernels.triton_moe import fused_moe_triton
torch.manual_seed(0)
dev = "cuda"

def groups(results):
    reps, out = [], []
    for key, t in results:
        for gi, r in enumerate(reps):
            if torch.equal(r, t):
                out.append((key, gi)); break
        else:
            reps.append(t); out.append((key, len(reps) - 1))
    return out

def report(title, results):
    g = groups(results)
    print(f"== {title}: {len(set(x for _, x in g))} distinct row-0 results")
    by = {}
    for key, gi in g:
        by.setdefault(gi, []).append(key)
    for gi, keys in by.items():
        print(f"  group {gi}: {keys[:12]}{' ...' if len(keys) > 12 else ''} ({len(keys)})")

for (N, K) in [(2048, 2048), (576, 2048), (3072, 2048), (2048, 10944), (7168, 16384)]:
    w, s = quantize_weight(torch.randn(N, K, device=dev) * 0.02)
    x = torch.randn(128, K, device=dev, dtype=torch.bfloat16)
    res = []
    for tile in C.TILES:
        for split in (1, 2, 4, 8):
            for M in (1, 4, 16, 32, 128):
                try:
                    y = F8.gemm(x[:M], w, s, C.Config(tile, split))
                except Exception as e:
                    continue
                res.append(((tile.block_m, tile.block_n, tile.kstep, int(tile.fused), int(tile.swap), tile.warps, tile.stages, split, M), y[0].clone()))
    report(f"fp8 gemm {N}x{K}", res)
    # which keys depend on split only?
    g = dict(groups(res))
    bysplit = {}
    for key, gi in g.items():
        bysplit.setdefault(key[7], set()).add(gi)
    print("  groups per split:", {k: sorted(v) for k, v in bysplit.items()})
    byfused = {}
    for key, gi in g.items():
        byfused.setdefault((key[3], key[7]), set()).add(gi)
    print("  groups per (fused, split):", {k: sorted(v) for k, v in byfused.items()})

for kind in ("bf16", "fp8"):
    E, D, I, k = 64, 2048, 1408, 6
    w13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02
    if kind == "fp8":
        q13 = [quantize_weight(w13[e]) for e in range(E)]; q2 = [quantize_weight(w2[e]) for e in range(E)]
        W13, S13 = torch.stack([a for a, _ in q13]), torch.stack([b for _, b in q13])
        W2, S2 = torch.stack([a for a, _ in q2]), torch.stack([b for _, b in q2])
    x = torch.randn(128, D, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(128)])
    wts = torch.rand(128, k, device=dev)
    res = []
    tiles = set()
    for t in MT.DECODE[kind].values():
        tiles.update(t.values())
    tiles.add(MT.batch_tiles(kind, 100)); tiles.add(MT.batch_tiles(kind, 1000))
    for tl_ in sorted(tiles):
        for bm in (16, 64):
            for M in (1, 4, 16, 32, 128):
                try:
                    if kind == "fp8":
                        y = fused_moe_fp8_triton(x[:M], W13, S13, W2, S2, wts[:M], ids[:M], 0, block_m=bm, tiles=tl_)
                    else:
                        y = fused_moe_triton(x[:M], w13, w2, wts[:M], ids[:M], 0, block_m=bm, tiles=tl_)
                except Exception as e:
                    continue
                res.append(((tl_, bm, M), y[0].clone()))
    # production choice per M
    for M in (1, 4, 8, 16, 32, 64, 128):
        bm = MT.block_m(M, M * k, E); tl_ = MT.moe_tiles(kind, M, M * k, D, I, bm)
        print(f"  {kind} production M={M}: block_m {bm} tiles {tl_}")
    report(f"{kind} moe {D}x{I}", res)
