# session 36 probe (not part of Tandem): where a batch-32 verify step's extra time over a decode step goes, kernel by
# kernel. V2-Lite random weights, bf16, CUDA graphs as served; torch.profiler over 20 replays of each step
# (decode: 1 token a request; verify: k + 1), device time a step per kernel name, both side by side.
import sys, torch
from models.cuda_graphs import GraphedForward
from models.model import DraftModel, TargetModel
from models.presets import load_any
from models.runner import new_cache
B, K, CTX, N = int(sys.argv[1]) if len(sys.argv) > 1 else 32, 3, 128, 20
dev = "cuda" if torch.cuda.is_available() else "cpu"            # cpu: a smoke test with the tiny preset
target = load_any(TargetModel, "random:v2-lite:seed=0" if dev == "cuda" else "random:tiny:seed=0",
                  dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev, quantization="none")
D, V = target.cfg.hidden_size, target.cfg.vocab_size
tc = new_cache(target, num_blocks=B * (CTX // 16 + 4) + 8)
tf = GraphedForward(target, tc, D, tc.ckv.dtype, CTX + 64, max_tokens=max(64, B * (K + 1))) if dev == "cuda" else target
ids = [f"r{i}" for i in range(B)]
g = torch.Generator().manual_seed(B)
with torch.inference_mode():
    for r in ids:
        tc.allocate(r)
        target(torch.randint(3, V, (CTX,), generator=g).to(dev), tc.prepare([r], [CTX]), tc)

def step(n):
    with torch.inference_mode():
        h = tf(torch.randint(3, V, (B * n,), generator=g).to(dev), tc.prepare(ids, [n] * B), tc)
        target.compute_logits(h).argmax(-1).cpu()
    [tc.rollback(r, n) for r in ids]

out = {}
for n in (1, K + 1):
    for _ in range(5):
        step(n)
    act = torch.profiler.ProfilerActivity.CUDA if dev == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[act]) as p:
        for _ in range(N):
            step(n)
    t = (lambda e: e.self_device_time_total) if dev == "cuda" else (lambda e: e.self_cpu_time_total)
    out[n] = {e.key: t(e) / N for e in p.key_averages() if t(e) > 0}
names = sorted(set(out[1]) | set(out[K + 1]), key=lambda k: -(out[K + 1].get(k, 0) - out[1].get(k, 0)))
print(f"batch {B}: device us a step, decode (1 token) / verify ({K + 1} tokens) / difference")
print(f"  {'total':60s} {sum(out[1].values()):9.1f} {sum(out[K + 1].values()):9.1f} {sum(out[K + 1].values()) - sum(out[1].values()):9.1f}")
for k in names[:30]:
    a, b = out[1].get(k, 0.0), out[K + 1].get(k, 0.0)
    print(f"  {k[:60]:60s} {a:9.1f} {b:9.1f} {b - a:9.1f}")
