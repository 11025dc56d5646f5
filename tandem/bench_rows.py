"""`tandem bench rows`: whether a verify row gets the decode row's bits, module by module. Lossless greedy
speculation needs the target to give a position the same logits in a verify step (K + 1 rows) as in a decode step
(one row); an op whose arithmetic changes with the row count (cuBLAS's fp32 GEMV, a kernel tuned per row count)
breaks that at near-ties.

B pairs of requests, the two of a pair with the same prompt, all prefilled in one call; one decode step of the B
first ones (B rows) and one verify of the B second ones (the same first tokens, then K drafts each: B (K + 1) rows)
run eagerly with forward hooks on every module down to DEPTH; each request's decode row is compared bit for bit with
the first row of its verify (a batch-invariance probe when B > 1). Reports the modules that differ (in call order,
with the largest difference) and the final logits. Eager, so graph-only effects are not seen (`tandem bench fp8
--parts v2lite` checks K = 3 against K = 0 outputs with graphs). On CUDA the MLA attention is the Triton kernel, as
in graphs.

    tandem bench rows --device cuda --random-config v2-lite --quantization none,fp8 --batches 1,4,32
"""
from __future__ import annotations

import argparse
import os

import torch

from tandem.bench import write_results

DEPTH = 4                       # module names with at most this many dots are hooked


def capture(model) -> tuple[list, list]:
    """Hooks recording (module name, its output as fp32) in call order -> (records, hooks)."""
    records, hooks = [], []
    for name, mod in model.named_modules():
        if name.count(".") > DEPTH:
            continue

        def hook(_m, _i, out, name=name):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] >= 1:
                records.append((name or "(the model)", t.detach().float().clone()))
        hooks.append(mod.register_forward_hook(hook))
    return records, hooks


def compare(one: list, many: list, batch: int, rows: int) -> list[dict]:
    """The modules whose decode rows ([batch, ...], a row a request) differ from the verify's first row of each
    request ([batch * rows, ...]); outputs not laid out a row a token (grouped expert rows) are skipped."""
    differ = []
    for (n, a), (_, b) in zip(one, many):
        if a.shape[0] != batch or b.shape[0] != batch * rows:
            continue
        b = b[::rows]
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a - b).abs().max().item() if a.shape == b.shape else None
            same = sum(torch.equal(x, y) for x, y in zip(a, b)) if a.shape == b.shape else 0
            differ.append({"module": n, "max_abs_diff": diff, "rows_differ": batch - same})
    return differ


def probe(engine, prompts: list[list[int]], drafts: list[list[int]]) -> dict:
    """Each request's decode row (a batch of len(prompts) one-row requests) vs its verify's first row (the same
    batch, each request 1 + len(drafts[i]) rows) -> the modules that differ."""
    from services.sampling import Sampling
    engine.forward = engine.model                                           # eager: hooks fire
    B, rows = len(prompts), 1 + len(drafts[0])
    ids = {"decode": [f"rows-d{i}" for i in range(B)], "verify": [f"rows-v{i}" for i in range(B)]}
    engine.prefill([(rid, p, Sampling()) for rids in ids.values() for rid, p in zip(rids, prompts)])  # alike
    runs = {}
    for kind, rids in ids.items():
        records, hooks = capture(engine.model)
        try:
            engine.verify([(rid, d if kind == "verify" else [], None) for rid, d in zip(rids, drafts)])
        finally:
            for h in hooks:
                h.remove()
        runs[kind] = records
    engine.release(ids["decode"] + ids["verify"])
    one, many = runs["decode"], runs["verify"]
    if [n for n, _ in one] != [n for n, _ in many]:
        raise RuntimeError("the decode and the verify called different modules")
    return {"batch": B, "rows": rows, "compared": len(one), "differ": compare(one, many, B, rows)}


def first_differ(r: dict) -> str:
    return ", ".join(f"{d['module']} ({'shape' if d['max_abs_diff'] is None else format(d['max_abs_diff'], '.1e')}, "
                     f"{d['rows_differ']})" for d in r["differ"][:4]) or "-"


def main(argv=None) -> int:
    from models.model import TargetModel
    from models.presets import random_model_id
    from models.tiny import default_model
    from services.config import DTYPES
    from services.launch import build_engine
    from services.target.engine import TargetEngine
    p = argparse.ArgumentParser(prog="tandem bench rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--random-config", default="", help="a models/presets.py preset with random weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quantization", default="none", help="comma-separated: none | fp8 | auto, a run each")
    p.add_argument("--drafts", type=int, default=3, help="K: the verify has K + 1 rows")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes B, a probe each")
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the services use 1; CPU GEMMs give a "
                   "row other bits at other row counts on more threads, BENCHMARKS.md \"Lossless on the CPU\")")
    p.add_argument("--out", default="results/rows")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = "cuda:0" if a.device == "cuda" else a.device
    if device.startswith("cuda"):
        os.environ.setdefault("TANDEM_ATTENTION", "triton")               # the kernel CUDA graphs run
    model = random_model_id(a.random_config, 0) if a.random_config else str(a.model or default_model())
    batches = [int(b) for b in a.batches.split(",")]
    results, md = [], [f"`tandem bench rows {' '.join(argv or [])}`", "",
                       "| quantization | batch | verify rows a request | modules compared | differ | first that differ "
                       "(max abs diff, requests differing) |", "|---|---|---|---|---|---|"]
    for q in a.quantization.split(","):
        blocks = 64 + 2 * sum(batches) * (a.prompt_tokens // 16 + 2)             # every pair of every batch
        engine = build_engine(TargetEngine, TargetModel, model, device, DTYPES["bfloat16" if device.startswith(
            "cuda") else "float32"], num_blocks=blocks, graphs=False, what="tandem bench rows", quantization=q)
        for B in batches:
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(engine.vocab_size, (B, a.prompt_tokens), generator=g).tolist()
            drafts = torch.randint(engine.vocab_size, (B, a.drafts), generator=g).tolist()
            r = {"quantization": q, **probe(engine, prompts, drafts)}
            results.append(r)
            md.append(f"| {q} | {B} | {r['rows']} | {r['compared']} | {len(r['differ'])} | {first_differ(r)} |")
        del engine
    write_results(a.out, "rows", "\n".join(md) + "\n", {"model": model, "device": device, "runs": results})
    return 0
