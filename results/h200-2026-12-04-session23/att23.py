# Session 23, call C: the paged MLA decode kernel at V2-Lite's shape (16 heads, R 512, P 64, block 16) over its
# tile / warp choices, 1 and 32 rows, 64-4096 keys: time a launch inside a CUDA graph of 20 (rotating 4 inputs),
# registers and spills of each compiled variant, and the output against the default choice.
import statistics, sys
import torch, triton
from kernels import triton_mla as tm

dev, H, R, P, bs, NB = "cuda", 16, 512, 64, 16, 8192
g = torch.Generator(device=dev).manual_seed(0)
ckv = torch.randn(NB, bs, R, dtype=torch.bfloat16, device=dev, generator=g)
kpe = torch.randn(NB, bs, P, dtype=torch.bfloat16, device=dev, generator=g)
arr = torch.zeros(1 << 15, dtype=torch.int32, device=dev)
W = 257                                            # table width of max_model_len 4096 (as served)


def inputs(N, keys, seed):
    gg = torch.Generator(device=dev).manual_seed(seed)
    tables = torch.stack([torch.randperm(NB, device=dev, generator=gg)[:W] for _ in range(N)]).int()
    return (torch.randn(N, H, R, dtype=torch.bfloat16, device=dev, generator=gg) * 0.05,
            torch.randn(N, H, P, dtype=torch.bfloat16, device=dev, generator=gg) * 0.05, tables,
            torch.arange(N, device=dev, dtype=torch.int32), torch.full((N,), keys - 1, device=dev),
            torch.full((N,), keys, device=dev, dtype=torch.int32))


def run(x, out, block_n, warps):
    q, qp, t, req, pos, clen = x
    return tm.mla_attention_triton(q, qp, ckv, kpe, t, req, pos, clen, 0.07, out=out, block_n=block_n,
                                   num_warps=warps, arrivals=arr)


def spills():
    res = set()
    try:
        for cache in tm._mla_kernel.device_caches.values():
            for k in cache[0].values():
                res.add((k.metadata.num_warps, k.n_regs, k.n_spills))
    except Exception as e:                          # noqa: BLE001
        res.add(str(e)[:60])
    return sorted(res, key=str)


CHOICES = [(None, None), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (16, 2), (32, 2)]
for N in (1, 32):
    for keys in (64, 128, 256, 1024, 4096):
        xs = [inputs(N, keys, s) for s in range(4)]
        base = [run(x, None, None, None) for x in xs]
        line = []
        for bn, w in CHOICES:
            outs = [torch.empty(N, H, R, dtype=torch.bfloat16, device=dev) for _ in xs]
            for x, o in zip(xs, outs):
                run(x, o, bn, w)
            torch.cuda.synchronize()
            err = max(float((o.float() - b.float()).abs().max()) for o, b in zip(outs, base))
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for i in range(20):
                    run(xs[i % 4], outs[i % 4], bn, w)
            ts = []
            for _ in range(7):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1000 / 20)
            line.append(f"{bn or 'def'}/{w or 'def'} {statistics.median(ts):.1f}us (err {err:.1e})")
        print(f"== rows {N} keys {keys}: " + " | ".join(line), flush=True)
print("compiled (warps, regs, spills):", spills())
