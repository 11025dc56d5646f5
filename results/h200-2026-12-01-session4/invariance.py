"""Which op makes a verify row (4 rows) differ from a decode row (1 row)? V2-Lite random, bf16 and fp8."""
import os, sys, torch, torch.nn.functional as F
os.environ.setdefault("TANDEM_ATTENTION", "triton")
from types import SimpleNamespace
from services.sampling import Sampling
from models.presets import random_model_id
from tandem.bench_fp8_models import _engine, _free

torch.manual_seed(0)
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
print("== cuBLAS rows: F.linear(x[:m])[0] == F.linear(x[:1])[0]?")
for name, N, K, dt in ([] if dev == "cpu" else [("q", 3072, 2048, torch.bfloat16), ("kv_a", 576, 2048, torch.bfloat16),
                       ("o", 2048, 2048, torch.bfloat16), ("shared gu", 2816, 2048, torch.bfloat16),
                       ("shared down", 2048, 1408, torch.bfloat16), ("dense gu", 10944, 2048, torch.bfloat16),
                       ("lm head", 102400, 2048, torch.bfloat16), ("router fp32", 64, 2048, torch.float32),
                       ("kv_b", 4096, 512, torch.bfloat16)]):
    w = (torch.randn(N, K, device=dev) * 0.02).to(dt)
    x = torch.randn(16, K, device=dev).to(dt)
    base = F.linear(x[:1], w)[0]
    res = {m: bool(torch.equal(F.linear(x[:m], w)[0], base)) for m in (2, 3, 4, 5, 8, 16)}
    b8 = F.linear(x[:8], w)[0]
    res8 = {m: bool(torch.equal(F.linear(x[:m], w)[0], b8)) for m in (2, 4, 5, 16)}
    print(f"{name:12s} vs 1 row: {res}   vs 8 rows: {res8}")

def capture(model):
    outs, hooks = [], []
    for n, mod in model.named_modules():
        if n.count(".") > 4:
            continue
        def hook(_m, _i, o, n=n):
            t = o[0] if isinstance(o, (tuple, list)) else o
            if torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] >= 1:
                outs.append((n, t[0].detach().float().clone()))
        hooks.append(mod.register_forward_hook(hook))
    return outs, hooks

model_id = random_model_id(sys.argv[2] if len(sys.argv) > 2 else "v2-lite", 0)
a = SimpleNamespace(device=dev, small=False)
for q in ("none", "fp8"):
    _free(dev)
    te = _engine(model_id, a, q, blocks=128)
    te.forward = te.model                                     # eager, hooks fire
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(min(1000, te.vocab_size), (24,), generator=g).tolist()
    for rid in ("a", "b"):
        te.prefill([(rid, prompt, Sampling())])
    runs = {}
    for rid, drafts in (("a", []), ("b", [11, 12, 13])):
        outs, hooks = capture(te.model)
        te.verify([(rid, drafts, None)])
        for h in hooks: h.remove()
        runs[rid] = outs
    print(f"== {q}: modules in call order, first 25 where row 0 of the 4-row verify differs from the 1-row decode")
    shown = 0
    for (n1, t1), (n2, t2) in zip(runs["a"], runs["b"]):
        if n1 != n2:
            print("order differs", n1, n2); break
        if t1.shape != t2.shape or not torch.equal(t1, t2):
            d = (t1 - t2).abs().max().item() if t1.shape == t2.shape else float("nan")
            print(f"  {n1:45s} max|diff| {d:.3e}  shape {tuple(t1.shape)}")
            shown += 1
            if shown >= 25: break
    print(f"  ({len(runs['a'])} module outputs compared; {shown} shown)")
    del te
