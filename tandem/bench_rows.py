"""`tandem bench rows`: whether a verify row gets the decode row's bits, module by module. Lossless greedy
speculation needs the target to give a position the same logits in a verify step (K + 1 rows) as in a decode step
(one row); an op whose arithmetic changes with the row count (cuBLAS's fp32 GEMV, a kernel tuned per row count)
breaks that at near-ties.

Two requests get the same prompt, prefilled alike; one decode step of the first and one verify of the second
(its first token the same, then K drafts) run eagerly with forward hooks on every module down to DEPTH; row 0 of
each module's output is compared bit for bit. Reports the modules that differ (in call order, with the largest
difference) and the final logits. Eager, so graph-only effects are not seen (`tandem bench fp8 --parts v2lite`
checks K = 3 against K = 0 outputs with graphs). On CUDA the MLA attention is the Triton kernel, as in graphs.

    tandem bench rows --device cuda --random-config v2-lite --quantization none,fp8
"""
from __future__ import annotations

import argparse
import os

import torch

from tandem.bench import write_results

DEPTH = 4                       # module names with at most this many dots are hooked


def capture(model) -> tuple[list, list]:
    """Hooks recording (module name, row 0 of its output as fp32) in call order -> (records, hooks)."""
    records, hooks = [], []
    for name, mod in model.named_modules():
        if name.count(".") > DEPTH:
            continue

        def hook(_m, _i, out, name=name):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] >= 1:
                records.append((name or "(the model)", t[0].detach().float().clone()))
        hooks.append(mod.register_forward_hook(hook))
    return records, hooks


def probe(engine, prompt: list[int], drafts: list[int]) -> dict:
    """Row 0 of a 1-row decode vs a (1 + len(drafts))-row verify of the same position -> the differences."""
    from services.sampling import Sampling
    engine.forward = engine.model                                           # eager: hooks fire
    runs, steps = {}, (("rows-decode", []), ("rows-verify", drafts))
    engine.prefill([(rid, prompt, Sampling()) for rid, _ in steps])        # one call: both rows alike
    for rid, d in steps:
        records, hooks = capture(engine.model)
        try:
            engine.verify([(rid, d, None)])
        finally:
            for h in hooks:
                h.remove()
        runs[rid] = records
    engine.release(["rows-decode", "rows-verify"])
    one, many = runs["rows-decode"], runs["rows-verify"]
    if [n for n, _ in one] != [n for n, _ in many]:
        raise RuntimeError("the decode and the verify called different modules")
    differ = [{"module": n, "max_abs_diff": (a - b).abs().max().item() if a.shape == b.shape else None}
              for (n, a), (_, b) in zip(one, many) if a.shape != b.shape or not torch.equal(a, b)]
    return {"rows": 1 + len(drafts), "compared": len(one), "differ": differ}


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
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--out", default="results/rows")
    a = p.parse_args(argv)
    device = "cuda:0" if a.device == "cuda" else a.device
    if device.startswith("cuda"):
        os.environ.setdefault("TANDEM_ATTENTION", "triton")               # the kernel CUDA graphs run
    model = random_model_id(a.random_config, 0) if a.random_config else str(a.model or default_model())
    results, md = [], [f"`tandem bench rows {' '.join(argv or [])}`", "",
                       "| quantization | verify rows | modules compared | differ | first that differ (max abs diff) |",
                       "|---|---|---|---|---|"]
    for q in a.quantization.split(","):
        engine = build_engine(TargetEngine, TargetModel, model, device, DTYPES["bfloat16" if device.startswith(
            "cuda") else "float32"], num_blocks=64, graphs=False, what="tandem bench rows", quantization=q)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(engine.vocab_size, (a.prompt_tokens,), generator=g).tolist()
        drafts = torch.randint(engine.vocab_size, (a.drafts,), generator=g).tolist()
        r = {"quantization": q, **probe(engine, prompt, drafts)}
        results.append(r)
        first = ", ".join(f"{d['module']} ({'shape' if d['max_abs_diff'] is None else format(d['max_abs_diff'], '.1e')})"
                          for d in r["differ"][:4]) or "-"
        md.append(f"| {q} | {r['rows']} | {r['compared']} | {len(r['differ'])} | {first} |")
        del engine
    write_results(a.out, "rows", "\n".join(md) + "\n", {"model": model, "device": device, "runs": results})
    return 0
