"""`tandem bench fp8`: DeepSeek's fp8 weights kept as fp8 (issue 15): kernels, step times, memory, accuracy.

Parts (--parts, all by default; each a table in OUT/fp8.md and OUT/fp8.json):
  kernels   the block-scaled fp8 GEMM (kernels/triton_fp8.py) at DeepSeek-V3's projection shapes and the fused
            fp8 MoE (kernels/triton_fp8_moe.py, 256 experts of 2048, top-8) at 1, 32 and 128 tokens, against bf16
            (F.linear / the bf16 fused MoE), torch._scaled_mm (same scheme, cuBLAS) and the fp8 byte floor (bytes
            read / 4.23 TB/s, an H200's HBM3e). GPU times are CUDA-graph replays over weight copies that do not
            fit in L2 (every byte comes from HBM, as in decode).
  load      peak device memory while an fp8 checkpoint loads, against the fp8 weights it holds (and a bf16 load).
  v2lite    V2-Lite (random weights) bf16 vs fp8 in one run: K = 0 verify step at batch 1 and 32, weights memory.
  v3        the V3-shape fp8 slice (preset v3-slice-fp8): K = 0 and K = 3 verify steps against the fp8 byte floor,
            and an estimate for the full 61-layer model on eight GPUs (tandem/bench_fp8_models.py).
  accuracy  the bundled model, bf16 vs --quantization fp8: greedy token agreement (teacher-forced on bf16's
            greedy continuation), held-out perplexity, mean acceptance length at K = 3 with the MTP layer in fp8
            and in bf16.
On CPU (--small: sizes for a quick check) the same code runs the PyTorch reference (kernels/fp8.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.bench import write_results

FLOOR_BW = 4.23e12                      # bytes/s: an H200's HBM3e, the byte floors' denominator on a GPU
# DeepSeek-V3's linear layers at one GPU (no TP): name, out N, in K
V3_GEMMS = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168), ("o_proj", 7168, 16384),
            ("expert gate/up", 2048, 7168), ("expert down", 7168, 2048), ("dense up", 18432, 7168),
            ("dense down", 7168, 18432)]
SMALL_GEMMS = [("small a", 256, 512), ("small b", 512, 256)]


def device_time(fn, device: str, iters: int = 20) -> float:
    """Seconds per call of fn: on a GPU one CUDA graph of `iters` calls replayed (no launch gaps), else wall."""
    if not device.startswith("cuda"):
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                                    # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / iters)
    return statistics.median(times)


def rotating(make, nbytes: int, device: str) -> list:
    """Copies of make() enough to exceed L2 (256 MB) on a GPU, one on CPU."""
    n = max(1, -(-(256 << 20) // max(nbytes, 1))) if device.startswith("cuda") else 1
    return [make() for _ in range(min(n, 64))]


def cycle(fn, items):
    state = {"i": 0}

    def step():
        fn(items[state["i"] % len(items)])
        state["i"] += 1
    return step


def time_gemm(name: str, N: int, K: int, M: int, device: str, iters: int = 20) -> dict:
    from kernels import dispatch
    from kernels.fp8 import quantize_weight
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x = torch.randn(M, K, device=device).to(dt)
    ws = rotating(lambda: quantize_weight(torch.randn(N, K, device=device, dtype=dt) * 0.02), N * K, device)
    row = {"kernel": name, "N": N, "K": K, "tokens": M}
    row["fp8_us"] = 1e6 * device_time(cycle(lambda w: dispatch.fp8_linear(x, *w), ws), device, iters)
    wide = rotating(lambda: torch.randn(N, K, device=device, dtype=dt), 2 * N * K, device)
    row["bf16_us"] = 1e6 * device_time(cycle(lambda w: torch.nn.functional.linear(x, w), wide), device, iters)
    del wide
    row["scaled_mm_us"] = scaled_mm_time(x, ws, device)
    nbytes = N * K + 4 * -(-N // 128) * -(-K // 128) + M * K * x.element_size() + M * N * x.element_size()
    row["floor_us"] = 1e6 * nbytes / FLOOR_BW
    row["fp8_vs_floor"] = row["fp8_us"] / row["floor_us"]
    return row


def scaled_mm_time(x, ws, device: str) -> float | None:
    """torch._scaled_mm with DeepSeek's scales (1x128 activations, 128x128 weights); None where it refuses."""
    if not device.startswith("cuda") or not hasattr(torch, "_scaled_mm"):
        return None
    from kernels.fp8 import quantize_act
    q, s = quantize_act(x)                                       # outside the timing: the GEMM alone
    s = s.t().contiguous().t()                                   # [M, K/128], outer-dim-major

    def run(w):
        return torch._scaled_mm(q, w[0].t(), scale_a=s, scale_b=w[1].t(), out_dtype=torch.bfloat16)
    try:
        return 1e6 * device_time(cycle(run, ws), device)
    except Exception as e:                                     # M = 1: CUBLAS_STATUS_NOT_SUPPORTED
        print(f"  _scaled_mm refused M={x.shape[0]}: {str(e).splitlines()[0][:100]}", flush=True)
        torch.cuda.synchronize()
        return None


def time_moe(M: int, device: str, small: bool) -> dict:
    """The routed experts of one V3 MoE layer (or a small one on CPU): fp8 fused vs bf16 fused, uniform routing."""
    from kernels.fp8 import FP8, fused_moe_fp8
    E, D, I, k = (8, 128, 128, 2) if small else (256, 7168, 2048, 8)
    g = torch.Generator(device=device).manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(M)])
    weights = torch.rand(M, k, generator=g, device=device)
    cuda = device.startswith("cuda")
    dt = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(M, D, device=device).to(dt)
    w13 = (torch.randn(E, 2 * I, D, device=device, dtype=dt) * 0.02).to(FP8)
    w2 = (torch.randn(E, D, I, device=device, dtype=dt) * 0.02).to(FP8)
    s13 = torch.full((E, 2 * (-(-I // 128)), -(-D // 128)), 0.01, device=device)
    s2 = torch.full((E, -(-D // 128), -(-I // 128)), 0.01, device=device)
    if cuda:
        from kernels.triton_fp8_moe import fused_moe_fp8_triton as fp8_moe
        from kernels.triton_moe import fused_moe_triton
    else:
        fp8_moe = fused_moe_fp8
    touched = len(set(ids.flatten().tolist()))
    row = {"kernel": f"MoE {E}x{I} top-{k}", "N": D, "K": I, "tokens": M, "experts_touched": touched}
    row["fp8_us"] = 1e6 * device_time(lambda: fp8_moe(x, w13, s13, w2, s2, weights, ids, 0), device, 2 if small else 5)
    if cuda:                                             # the bf16 twin (22.5 GB at V3's shapes)
        b13, b2 = w13.to(dt), w2.to(dt)
        del w13, w2
        row["bf16_us"] = 1e6 * device_time(lambda: fused_moe_triton(x, b13, b2, weights, ids, 0), device, 5)
        del b13, b2
        torch.cuda.empty_cache()
    row["floor_us"] = 1e6 * touched * 3 * D * I / FLOOR_BW
    row["fp8_vs_floor"] = row["fp8_us"] / row["floor_us"]
    return row


def kernels_part(device: str, small: bool) -> list[dict]:
    rows = []
    for M in ((1, 4) if small else (1, 32, 128)):
        for name, N, K in (SMALL_GEMMS if small else V3_GEMMS):
            rows.append(time_gemm(name, N, K, M, device, 2 if small else 20))
            print(kernel_line(rows[-1]), flush=True)
        rows.append(time_moe(M, device, small))
        print(kernel_line(rows[-1]), flush=True)
    return rows


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def kernel_line(r: dict) -> str:
    return (f"| {r['kernel']} | {r['N']}x{r['K']} | {r['tokens']} | {fmt(r['fp8_us'])} | {fmt(r.get('bf16_us'))} | "
            f"{fmt(r.get('scaled_mm_us'))} | {fmt(r['floor_us'])} | {r['fp8_vs_floor']:.2f} |")


def kernel_table(rows: list[dict]) -> str:
    head = ("| kernel | N x K | tokens | fp8 us | bf16 us | _scaled_mm us | fp8 floor us | fp8 / floor |\n"
            "|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(kernel_line(r) for r in rows)


def main(argv=None) -> int:
    from tandem import bench_fp8_models as models
    p = argparse.ArgumentParser(prog="tandem bench fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default="kernels,load,v2lite,v3,accuracy")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes and counts (the test's quick run)")
    p.add_argument("--model", default=None, help="accuracy: a trained checkpoint (default: the bundled model)")
    p.add_argument("--prompts", type=int, default=32, help="accuracy: held-out prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="accuracy: greedy tokens per prompt")
    p.add_argument("--out", default="results/fp8")
    a = p.parse_args(argv)
    a.device = "cuda:0" if a.device == "cuda" else a.device
    if a.device == "cpu":             # as the services run (a row's GEMM bits depend on its row count on more)
        torch.set_num_threads(1)
    parts = [x for x in a.parts.split(",") if x]
    unknown = set(parts) - {"kernels", "load", "v2lite", "v3", "accuracy"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}, expected kernels,load,v2lite,v3,accuracy")
    result, md = {"device": a.device, "date": time.strftime("%Y-%m-%d")}, [f"`tandem bench fp8 {' '.join(argv or [])}`"]
    for part in parts:
        t0 = time.time()
        if part == "kernels":
            result["kernels"] = kernels_part(a.device, a.small)
            md += ["", "## fp8 kernels", "", f"On {a.device}: fp8 is the Triton kernel on a GPU, the PyTorch reference on "
                   "a CPU; bf16: F.linear and the bf16 fused MoE; _scaled_mm: the GEMM alone (activations quantized "
                   "before); floor: weight + activation bytes / 4.23 TB/s.", "", kernel_table(result["kernels"])]
        else:
            result[part], text = getattr(models, f"{part}_part")(a)
            md += ["", text]
        print(f"tandem bench fp8: {part} took {time.time() - t0:.0f} s", flush=True)
        write_results(a.out, "fp8", "\n".join(md) + "\n", result)      # after each part: a partial run still reports
    return 0
