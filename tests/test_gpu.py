"""GPU end to end: `tandem serve --device cuda` (target on cuda:0, draft on cuda:1 over the NCCL bridge
when two GPUs are present; one GPU: both on cuda:0 over the CUDA IPC bridge). Skipped without CUDA."""
import pytest
import torch

from bridge_checks import assert_bridge_contract
from gpu_cluster import serve_cuda
from tandem.v1 import common_pb2, generate_pb2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")


@pytest.fixture(scope="module")
def cuda_cluster(tmp_path_factory):
    with serve_cuda(tmp_path_factory.mktemp("gpu"), []) as (gateway, target, draft, _):
        yield gateway, target, draft


def test_cuda_greedy_speculation_equals_plain_decoding(cuda_cluster):
    gateway, _, _ = cuda_cluster
    accepted = 0
    for i in range(12):
        prompt = [(13 * i + 7 * j) % 500 + 3 for j in range(2 + 3 * i)]
        outs = {}
        for k in (0, 1, 2, 3):
            r = gateway.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt),
                                 max_tokens=24, ignore_eos=True, num_speculative_tokens=k), timeout=120)
            outs[k] = list(r.token_ids)
            accepted += r.spec_stats.num_accepted_tokens
        assert outs[1] == outs[0] and outs[2] == outs[0] and outs[3] == outs[0], (i, outs)
    assert accepted > 0                      # the rounds really accepted drafts on the GPU


def test_bridge_carries_rows_and_contract_fires_on_cuda(cuda_cluster):
    _, target, draft = cuda_cluster
    assert_bridge_contract(target, draft, "gpu-contract", [5, 9, 17, 33, 65, 129])
    target.Release(common_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
    draft.Release(common_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
