"""FlashInfer's chain speculative sampling as the alternative verifier: same contract and the same
(lossless) law as kernels.speculative.rejection_sample. Skipped without CUDA or without flashinfer."""
import pytest
import torch

from kernels import flashinfer_sampling
from kernels.speculative import rejection_sample

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none"),
    pytest.mark.skipif(not flashinfer_sampling._flashinfer(), reason="flashinfer does not import here"),
]


def test_chain_verify_agrees_with_tandem_on_certain_outcomes():
    # one-hot p and q: acceptance is certain, so both verifiers must give the same tokens
    dev, V = "cuda", 16
    target = torch.tensor([[3, 5, 7, 9], [3, 6, 7, 9], [2, 5, 7, 9]], device=dev)      # [B, K+1]
    drafts = torch.tensor([[3, 5, 7], [3, 5, 7], [3, 5, 7]], device=dev)               # [B, K]
    p = torch.nn.functional.one_hot(target, V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    acc, out = flashinfer_sampling.chain_verify(p, q, drafts)
    k = torch.full((3,), 3, device=dev)
    ref_acc, ref_out = rejection_sample(p, q, drafts, k, torch.rand(3, 3, device=dev),
                                        torch.empty(3, V, device=dev).exponential_())
    assert acc.tolist() == ref_acc.tolist() == [3, 1, 0]
    assert out.tolist() == ref_out.tolist()


def test_chain_verify_is_lossless_in_distribution():
    # many independent rows of one (p, q) pair with drafts drawn from q: the first emitted token
    # must follow p[0], and position 0 is accepted with probability sum_x min(p0, q0)
    torch.manual_seed(0)
    dev, V, K, N = "cuda", 6, 2, 200_000
    p1 = torch.softmax(torch.randn(K + 1, V, device=dev) * 1.5, -1)
    q1 = torch.softmax(torch.randn(K, V, device=dev) * 1.5, -1)
    drafts = torch.multinomial(q1, N, replacement=True).T.contiguous()                 # [N, K]
    acc, out = flashinfer_sampling.chain_verify(p1.expand(N, -1, -1), q1.expand(N, -1, -1), drafts)
    first = torch.bincount(out[:, 0], minlength=V).float() / N
    tv = 0.5 * (first - p1[0]).abs().sum().item()
    assert tv < 0.01, (first.tolist(), p1[0].tolist())
    expect = torch.minimum(p1[0], q1[0]).sum().item()
    assert abs((acc >= 1).float().mean().item() - expect) < 0.01
