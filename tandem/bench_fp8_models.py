"""The model-level parts of `tandem bench fp8` (tandem/bench_fp8.py): loading memory, V2-Lite bf16 vs fp8, the
V3-shape slice against its floor with an eight-GPU estimate, and accuracy on the bundled model.
Each `*_part(a)` returns (data, markdown)."""
from __future__ import annotations

import math
import re
import statistics
import tempfile

import torch

from tandem.bench_fp8 import FLOOR_BW


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _bandwidth(device: str) -> float:
    from tandem.bench_floor import copy_bandwidth
    return FLOOR_BW if device.startswith("cuda") else copy_bandwidth(device, 64 << 20)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _free(device: str) -> None:
    import gc
    gc.collect()                       # engines hold their CUDA graphs in reference cycles
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def load_part(a) -> tuple[list[dict], str]:
    """Peak device memory while loading an fp8 checkpoint (V2-Lite's shapes, 4 layers) kept fp8, then dequantized."""
    from models.config import ModelConfig
    from models.loader import build, checkpoint_tensors, load_model, save_checkpoint
    from models.model import TargetModel
    from models.presets import FP8, PRESETS, init_random_on_device_
    raw = {**PRESETS["tiny"], **FP8} if a.small else {**PRESETS["v2-lite-fp8"], "num_hidden_layers": 4}
    cuda, rows = a.device.startswith("cuda"), []
    with tempfile.TemporaryDirectory() as d:
        m = init_random_on_device_(build(TargetModel, ModelConfig.from_dict(raw), dtype=_dtype(a.device),
                                         device=a.device), 0)
        save_checkpoint(checkpoint_tensors(m), d, max_shard_bytes=1 << 30)
        del m
        import json
        from pathlib import Path
        (Path(d) / "config.json").write_text(json.dumps(raw))
        for q in ("fp8", "none"):
            _free(a.device)
            base = torch.cuda.memory_allocated() if cuda else 0
            torch.cuda.reset_peak_memory_stats() if cuda else None
            m = load_model(TargetModel, d, dtype=_dtype(a.device), device=a.device, quantization=q)
            peak = torch.cuda.max_memory_allocated() - base if cuda else None
            held = weight_bytes(m)
            rows.append({"load": "fp8 kept" if q == "fp8" else "dequantized (--quantization none)",
                         "weights_gb": held / 1e9, "peak_gb": None if peak is None else peak / 1e9,
                         "peak_over_weights": None if peak is None else peak / held})
            del m
    md = ["## Loading an fp8 checkpoint", "", f"{'tiny' if a.small else 'V2-Lite'} shapes, {raw['num_hidden_layers']} "
          f"layers, on {a.device}: "
          "device memory held by the weights and the peak while loading (torch.cuda.max_memory_allocated).", "",
          "| load | weights GB | peak GB while loading | peak / weights |", "|---|---|---|---|"]
    md += [f"| {r['load']} | {r['weights_gb']:.3f} | {_f(r['peak_gb'], '.3f')} | {_f(r['peak_over_weights'], '.3f')} |"
           for r in rows]
    return rows, "\n".join(md)


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _steps(engine, batches, ks, a, bw) -> list[dict]:
    from tandem.bench_floor import measure
    warmup, iters = (1, 1) if a.small else (3, 10)
    return [measure(engine, b, k, 16 if a.small else 64, warmup, iters, bw, seed=100 * b + k)
            for b in batches for k in ks]


def _engine(model: str, a, quantization: str, blocks: int, draft: bool = False):
    """The target's (or the MTP draft's) engine as served, CUDA graphs captured on first use."""
    from models.model import DraftModel, TargetModel
    from services.draft.engine import DraftEngine
    from services.launch import build_engine
    from services.target.engine import TargetEngine
    engine_cls, model_cls = (DraftEngine, DraftModel) if draft else (TargetEngine, TargetModel)
    return build_engine(engine_cls, model_cls, model, a.device, _dtype(a.device), num_blocks=blocks,
                        max_model_len=1 << 30, graphs=True, graph_batch=0, what="tandem bench fp8",
                        quantization=quantization)


def v2lite_part(a) -> tuple[list[dict], str]:
    """V2-Lite bf16 then fp8, one process: K = 0 verify step at batch 1 and 32, weights memory; then K = 3 against
    K = 0 greedy (in process, the served round) with each weight format's own MTP draft, prompts one at a time (a
    decode row and a verify row share a row class: bit-equal) and all together (4 vs 16 rows: different classes,
    so near-ties of the random weights may break differently; reported, not promised)."""
    from models.presets import random_model_id
    from tandem.bench_inprocess import run_loop
    preset, batches = ("tiny", (1, 4)) if a.small else ("v2-lite", (1, 32))
    model, bw, rows, same = random_model_id(preset, 0), _bandwidth(a.device), [], {}
    prompts = [[(17 * i + 5 * j) % 1000 + 3 for j in range(8 + i)] for i in range(4)]
    n = 4 if a.small else 32
    for q in ("none", "fp8"):
        _free(a.device)
        te = _engine(model, a, q, blocks=max(batches) * 16 + 64)
        held = weight_bytes(te.model)
        rows += [{**r, "quantization": q, "weights_gb": held / 1e9} for r in _steps(te, batches, (0,), a, bw)]
        de = _engine(model, a, q, blocks=256, draft=True)                   # this target's own MTP draft
        for batch in (1, len(prompts)):
            k0, k3 = (run_loop(te, de, prompts, k, batch, n).outputs for k in (0, 3))
            same[f"{q} batch {batch}"] = sum(k0[i] == k3[i] for i in k0)
        del te, de
    _free(a.device)
    base = {r["batch"]: r for r in rows if r["quantization"] == "none"}
    for r in rows:
        r["step_vs_bf16"] = r["ms"] / base[r["batch"]]["ms"]
        r["weights_vs_bf16"] = r["weights_gb"] / base[r["batch"]]["weights_gb"]
    md = [f"## V2-Lite ({preset}, random weights): bf16 vs fp8, one run", "",
          f"K = 0 verify step (median, {a.device}), byte floor at {bw / 1e12:.2f} TB/s. Greedy K = 3 vs K = 0, "
          f"outputs of {n} tokens identical out of {len(prompts)}: " +
          ", ".join(f"{key.replace('none', 'bf16')}: {v}" for key, v in same.items()) + ".", "",
          "| weights | batch | step ms | step / bf16 | weights GB | weights / bf16 | floor ms | step / floor |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['quantization']} | {r['batch']} | {r['ms']:.3f} | {r['step_vs_bf16']:.3f} | {r['weights_gb']:.2f} | "
           f"{r['weights_vs_bf16']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.2f} |" for r in rows]
    return {"rows": rows, "k3_equals_k0": same, "prompts": len(prompts)}, "\n".join(md)


def layer_bytes(cfg, dtype) -> tuple[int, int, int, int, int]:
    """(a dense layer's bytes, a MoE layer's bytes without routed experts, one routed expert, one embedding row,
    the LM head) of cfg as held (fp8 where it quantizes)."""
    from models.loader import build
    from models.model import TargetModel
    m = build(TargetModel, cfg, dtype=dtype, device="meta")
    per, expert = {}, 0
    for name, p in m.named_parameters():
        at = re.match(r"model\.layers\.(\d+)\.", name)
        if at and ".mlp.experts." in name:
            expert += p.numel() * p.element_size()
        elif at:
            per[int(at.group(1))] = per.get(int(at.group(1)), 0) + p.numel() * p.element_size()
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    expert //= max(moe_layers * cfg.n_routed_experts, 1)
    return (per[0], per[cfg.first_k_dense_replace], expert, cfg.hidden_size * m.model.embed_tokens.weight.element_size(),
            m.lm_head.weight.numel() * m.lm_head.weight.element_size())


def step_bytes(cfg, sizes, layers: int, dense_layers: int, tokens: int) -> float:
    """Weight bytes of one step of `tokens` rows over a model of `layers` layers (`dense_layers` dense)."""
    from tandem.roofline import experts_touched
    dense, moe, expert, emb_row, head = sizes
    return (dense_layers * dense + (layers - dense_layers) * (moe + experts_touched(cfg, tokens) * expert)
            + min(tokens, cfg.vocab_size) * emb_row + head)


def v3_part(a) -> tuple[list[dict], str]:
    """The V3-shape fp8 slice: K = 0 and K = 3 verify steps against the byte floor; the full model's estimate."""
    from models.presets import model_config, random_model_id
    preset, batches = ("tiny", (1, 2)) if a.small else ("v3-slice-fp8", (1, 32))
    model, bw = random_model_id(preset, 0), _bandwidth(a.device)
    engine = _engine(model, a, "fp8", blocks=max(batches) * 16 + 64)
    rows = _steps(engine, batches, (0, 3), a, bw)
    del engine
    _free(a.device)
    cfg = model_config(model).quantized("fp8")
    sizes = layer_bytes(cfg, _dtype(a.device))
    full_layers, full_dense, gpus = 61, 3, 8
    for r in rows:
        full = step_bytes(cfg, sizes, full_layers, full_dense, r["rows"]) / gpus
        part = step_bytes(cfg, sizes, cfg.num_hidden_layers, cfg.first_k_dense_replace, r["rows"])
        r.update(full_floor_ms=1000 * full / bw, full_estimate_ms=r["ms"] * full / part)
    dense, moe, expert, emb_row, head = sizes
    held = (full_dense * dense + (full_layers - full_dense) * (moe + cfg.n_routed_experts * expert)
            + cfg.vocab_size * emb_row + head) / gpus
    md = [f"## DeepSeek-V3 shapes in fp8 ({preset}: {cfg.num_hidden_layers} layers, the first dense)", "",
          f"Verify step (K + 1 rows per request, forward + LM head) against its fp8 byte floor at {bw / 1e12:.2f} "
          "TB/s (weights read, the experts the routers picked, KV). Full model, eight GPUs: ESTIMATE, the slice's "
          f"measured time scaled by the weight bytes one GPU of {gpus} reads per step for {full_layers} layers "
          f"({full_dense} dense; TP/EP split evenly, uniform routing) over the bytes the slice reads; communication "
          f"(two all-reduces a layer) not included. Full model in fp8: {held / 1e9:.1f} GB of weights per GPU.", "",
          "| batch | K | rows | step ms | floor ms | step / floor | experts / layer | full model / GPU: floor ms | "
          "estimate ms |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['k']} | {r['rows']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.2f} | "
           f"{r['experts_per_layer']:.1f} | {r['full_floor_ms']:.3f} | {r['full_estimate_ms']:.3f} |" for r in rows]
    return {"rows": rows, "full_weights_gb_per_gpu": held / 1e9}, "\n".join(md)


@torch.inference_mode()
def causal_logits(model, ids: list[int]) -> torch.Tensor:
    # ids: [T] -> fp32 logits [T, V] of one whole-sequence forward (no cache)
    dev = next(model.parameters()).device
    return model.compute_logits(model(torch.tensor([ids], device=dev), None, None)[0])


def accuracy_part(a) -> tuple[dict, str]:
    """The bundled model: bf16 vs fp8 target (agreement, perplexity), K = 3 acceptance with MTP bf16 and fp8."""
    from models.tiny import default_model
    from tandem.bench import bench_prompts
    from tandem.bench_inprocess import make_engines, run_loop
    model = str(a.model or default_model())
    n, max_tokens = (2, 4) if a.small else (a.prompts, a.max_tokens)
    prompts = bench_prompts(model, n, 16 if a.small else 48, seed=7)
    texts = bench_prompts(model, n, 32 if a.small else 256, seed=8)        # held-out text for perplexity
    runs = {}
    for name, q, dq in (("bf16", "none", "none"), ("fp8, MTP fp8", "fp8", "fp8"), ("fp8, MTP bf16", "fp8", "none")):
        te, de = make_engines(model, a.device, quantization=q, draft_quantization=dq, num_blocks=1024,
                              graph_batch=0)
        k0 = run_loop(te, de, prompts, 0, n, max_tokens) if dq == q else runs["fp8, MTP fp8"]["k0"]
        k3 = run_loop(te, de, prompts, 3, n, max_tokens)
        nll = [torch.nn.functional.cross_entropy(causal_logits(te.model, t)[:-1], torch.tensor(t[1:], device=
               next(te.model.parameters()).device)).item() for t in texts]
        runs[name] = {"k0": k0, "mal": 1 + k3.accepted / max(k3.drafts, 1), "ppl": math.exp(statistics.mean(nll)),
                      "k3_equals_k0": sum(k3.outputs[i] == k0.outputs[i] for i in k0.outputs), "model": te.model}
        del de
    ref, fp8m = runs["bf16"]["k0"].outputs, runs["fp8, MTP fp8"]["model"]
    agree = total = 0
    for i, p in enumerate(prompts):                            # teacher-forced on bf16's greedy continuation
        pred = causal_logits(fp8m, p + ref[i])[len(p) - 1:-1].argmax(-1).tolist()
        agree, total = agree + sum(x == y for x, y in zip(pred, ref[i])), total + len(ref[i])
    free = sum(runs["fp8, MTP fp8"]["k0"].outputs[i] == ref[i] for i in ref)
    base = runs["bf16"]
    data = {name: {k: v for k, v in r.items() if k not in ("k0", "model")} for name, r in runs.items()}
    data.update(agreement=agree / total, identical_sequences=free, prompts=n, max_tokens=max_tokens)
    md = [f"## Accuracy: {model}, bf16 vs fp8 ({a.device})", "",
          f"{n} held-out prompts x {max_tokens} greedy tokens. Greedy token agreement (fp8 target's argmax on bf16's "
          f"greedy continuation, teacher-forced): **{agree / total:.4f}** ({agree}/{total}); whole outputs identical "
          f"free-running: {free}/{n}. Perplexity over {n} held-out texts. Mean acceptance length at K = 3.", "",
          "| target, MTP | held-out ppl | ppl / bf16 | MAL K=3 | MAL / bf16 | K=3 outputs = K=0 |", "|---|---|---|---|---|---|"]
    md += [f"| {name} | {r['ppl']:.4f} | {r['ppl'] / base['ppl']:.4f} | {r['mal']:.3f} | {r['mal'] / base['mal']:.3f} | "
           f"{r['k3_equals_k0']}/{n} |" for name, r in runs.items()]
    for r in runs.values():
        r.pop("model")
    _free(a.device)
    return data, "\n".join(md)
