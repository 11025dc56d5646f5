"""Lossless greedy needs a verify row (K + 1 rows a request) to get the same bits as the decode row (one): the ops
of a step must not change their arithmetic with the number of rows. Measured on an H200 (BENCHMARKS.md
"Lossless"): cuBLAS's bf16 GEMMs keep a row's bits from 1 to 16 rows, but its fp32 GEMV for one row does not match
the GEMM of two or more (nor, at DeepSeek-V3's 7168 columns, two rows those of sixteen): the router (fp32,
DeepSeek's rule) therefore runs in Triton (tests/test_kernel_rows.py) or, without it, as one class of 128 rows
(models/layers.dense_linear, as every bf16 projection). The fp8 GEMM and the fused MoE have their own class tests (test_fp8_kernels.py,
test_moe_kernels.py)."""
import pytest
import torch
import torch.nn.functional as F

from models.moe import router_logits

CUDA = torch.cuda.is_available()


def test_router_logits_are_fp32_and_a_rows_own_on_cpu():
    """fp32 logits; a row's bits the same at 1 to 3 rows (run as 4: kernels/rows.gemm_ready) as among 16 (one
    thread, as conftest and the services set)."""
    w, x = torch.randn(8, 32), torch.randn(16, 32).bfloat16()
    full = F.linear(x.float(), w)
    for m in (1, 2, 3, 5):
        out = router_logits(x[:m], w)
        assert out.dtype == torch.float32 and out.shape == (m, 8)
        assert torch.equal(out, full[:m])


def test_route_of_a_row_does_not_depend_on_the_rows_beside_it_on_cpu():
    """The reference expert choice on whole vectors: a [1, 8] tensor's sigmoid once gave a row other bits than
    the same row among 4 (the bundled model's router: 8 experts)."""
    from kernels.router import RouteSpec, select
    g = torch.Generator().manual_seed(4)          # rows 1-3 of these take other bits unpadded
    logits, bias = torch.randn(64, 8, generator=g), torch.randn(8, generator=g) * 0.1
    spec = RouteSpec(sigmoid=True, n_group=2, topk_group=1, top_k=2, noaux=True, norm=True, scale=2.5)
    w64, i64 = select(logits, bias, spec)
    for m in range(1, 64):
        w, i = select(logits[:m], bias, spec)
        assert torch.equal(w, w64[:m]) and torch.equal(i, i64[:m]), m


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA; this machine has none")
@pytest.mark.parametrize("E,D", [(64, 2048), (256, 7168)])             # V2-Lite's and DeepSeek-V3's routers
def test_router_rows_do_not_depend_on_their_neighbours(E, D):
    g = torch.Generator().manual_seed(E)
    w = (torch.randn(E, D, generator=g) * 0.02).bfloat16().cuda()
    x = torch.randn(128, D, generator=g).bfloat16().cuda()
    full = router_logits(x, w)                                          # decode and verify, any batch to 128 rows
    for m in (*range(1, 18), 31, 32, 33, 64, 100):
        assert torch.equal(router_logits(x[:m], w), full[:m]), m


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA; this machine has none")
@pytest.mark.parametrize("N,K", [(3072, 2048), (576, 2048), (2048, 1408), (102400, 2048)])
def test_bf16_linear_rows_do_not_depend_on_their_neighbours(N, K):
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(N, K, generator=g) * 0.02).bfloat16().cuda()
    x = torch.randn(16, K, generator=g).bfloat16().cuda()
    full = F.linear(x, w)
    for m in range(1, 17):
        assert torch.equal(F.linear(x[:m], w), full[:m]), m



@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA; this machine has none")
@pytest.mark.parametrize("N,K,dtype", [(10944, 2048, torch.bfloat16), (2048, 10944, torch.bfloat16),
                                       (3072, 2048, torch.bfloat16), (64, 2048, torch.float32)])
def test_model_linears_rows_do_not_depend_on_their_neighbours(N, K, dtype):
    """models/layers.dense_linear (every bf16 projection of the model, the LM head, the V3.2 indexer's fp32 head
    weights): a row's bits the same in calls of 1..128 rows, where plain cuBLAS parts 8 from 32 rows."""
    from models.layers import LINEAR_ROWS, dense_linear
    g = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=g) * 0.02).to(dtype).cuda()
    x = torch.randn(LINEAR_ROWS, K, generator=g).to(dtype).cuda()
    full = F.linear(x, w)
    for m in (1, 3, 8, 16, 17, 32, 64, 100, LINEAR_ROWS):
        assert torch.equal(dense_linear(x[:m], w), full[:m]), m
    assert torch.equal(dense_linear(x[:6].view(2, 3, K), w), full[:6].view(2, 3, N))
