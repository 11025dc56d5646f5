"""Session 28's plan: one MoE layer of `tandem train`'s editions, forward + backward over a 64 x 1024-token
micro-batch on the H200 (bf16 autocast, compiled as training compiles it), dense against grouped experts.
python3 .gpu/moe28.py OUT.json"""
import json, sys, time
import torch
from models.config import ModelConfig
from tandem import train, train_model

res = []
for arch in ([], ["n_routed_experts=16", "moe_intermediate_size=128"]):
    for moe in ("dense", "grouped"):
        c = train.parse(["--edition", "3", "--device", "cuda", "--moe", moe, "--arch=num_hidden_layers=2"]
                        + [f"--arch={a}" for a in arch])
        layer = train_model.build_models(ModelConfig.from_dict(train.model_config(c)), c)[2][0]
        x = torch.randn(65536, 256, device="cuda", requires_grad=True)

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                y = layer(x)
            y.float().square().mean().backward()
        fn = torch.compile(step)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / 20 * 1e3
        res.append(dict(arch=arch, moe=moe, ms=ms))
        print(f"{arch or 'edition 3'} {moe}: {ms:.3f} ms forward + backward, 65,536 tokens", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
