"""One MoE layer of tandem train forward + backward over 4096 tokens on this CPU (fp32, 2 threads), dense against grouped experts: a probe, not a tandem bench."""
import torch, time, sys
sys.path.insert(0,'.')
from tandem import train, train_model
from models.config import ModelConfig
from models.moe import MoE
torch.set_num_threads(2)
for E, I in ((8, 96), (16, 128)):
    c = train.parse(["--edition", "2", "--device", "cpu", f"--arch=n_routed_experts={E}", f"--arch=moe_intermediate_size={I}", "--arch=num_hidden_layers=2"])
    target, draft, moes, params = train_model.build_models(ModelConfig.from_dict(train.model_config(c)), c)
    moe = moes[0]
    x = torch.randn(4096, 256, requires_grad=True)
    for name, f in train_model.MOE_FORWARD.items():
        fn = f.__get__(moe)
        for i in range(4):
            if i == 1: t = time.perf_counter()
            y = fn(x); y.square().sum().backward()
        print(E, I, name, f"{(time.perf_counter()-t)/3*1e3:.1f} ms fwd+bwd, 4096 tokens")
