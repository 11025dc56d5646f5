"""Session 6, probe 4: what the one row class of models/layers.dense_linear costs at V2-Lite's bf16 shapes."""
import torch
import torch.nn.functional as F
from models.layers import dense_linear
src = open(".gpu/s6probe2.py").read().split("H, R, P, BS, CAP")[0]
exec(src)                                     # replay_us
SHAPES = {"q_proj 3072x2048": (3072, 2048), "kv_a 576x2048": (576, 2048), "o_proj 2048x2048": (2048, 2048),
          "dense gate/up 10944x2048": (10944, 2048), "dense down 2048x10944": (2048, 10944),
          "shared gate/up 2816x2048": (2816, 2048), "shared down 2048x2816": (2048, 2816),
          "lm head 102400x2048": (102400, 2048)}
print("| shape | rows | cuBLAS us | as 128 rows us |\n|---|---|---|---|")
for name, (N, K) in SHAPES.items():
    w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    for m in (1, 4, 32):
        x = torch.randn(m, K, device="cuda").bfloat16()
        print(f"| {name} | {m} | {replay_us(lambda: F.linear(x, w)):.1f} | {replay_us(lambda: dense_linear(x, w)):.1f} |",
              flush=True)
