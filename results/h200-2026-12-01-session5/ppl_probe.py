"""fp8 at > 128 rows on the GPU: cuBLAS's blockwise _scaled_mm against the reference, and the bundled model's
perplexity with and without it."""
import math, torch
from kernels import fp8, triton_fp8 as T, triton_fp8_config as C
torch.manual_seed(0)
for N, K in [(256, 256), (512, 128), (256, 768), (1536, 256), (512, 256), (2048, 2048), (3072, 2048), (2048, 1408), (7168, 2048)]:
    q, s = fp8.quantize_weight(torch.randn(N, K, device="cuda") * 0.02)
    for M in (128, 129, 256, 1000):
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = fp8.fp8_linear(x.float(), q, s)
        try:
            cub = T.scaled_mm(x, q, s).float() if N % 128 == 0 and K % 128 == 0 else None
        except RuntimeError as e:
            cub, _ = None, print(f"{N}x{K} M={M}: cublas refused: {str(e)[:60]}")
        tri = T.gemm(x, q, s, C.rule(N, K, C.LARGE)).float()
        rel = lambda o: ((o - ref).abs().max() / ref.abs().max()).item() if o is not None else None
        print(f"{N}x{K} M={M}: cublas {rel(cub)}  triton-large {rel(tri):.2e}", flush=True)
from models.model import TargetModel
from models.tiny import default_model
from services.launch import build_engine
from services.target.engine import TargetEngine
from tandem.bench import bench_prompts
from tandem.bench_fp8_models import causal_logits
model = str(default_model())
texts = bench_prompts(model, 8, 256, seed=8)
for q in ("none", "fp8"):
    te = build_engine(TargetEngine, TargetModel, model, "cuda:0", torch.bfloat16, num_blocks=256, graphs=False, what="probe", quantization=q)
    for label, fits in (("cublas", C.cublas_fits), ("no cublas", lambda N, K: False)):
        C.cublas_fits = fits
        nll = [torch.nn.functional.cross_entropy(causal_logits(te.model, t)[:-1], torch.tensor(t[1:], device="cuda")).item() for t in texts]
        print(q, label, "ppl", math.exp(sum(nll) / len(nll)), [round(v, 2) for v in nll], flush=True)
    del te
