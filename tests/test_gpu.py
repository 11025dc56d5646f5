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


def test_cuda_requests_joining_a_running_batch_equal_plain_decoding(cuda_cluster):
    """Requests sent 5 ms apart join the running batch: their prompts ride a Verify and their first Propose rides
    the target's push (one pass of the draft with the running requests' drafts, gateway/proposals.py join)."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    gateway, _, _ = cuda_cluster
    prompts = [[(17 * i + 5 * j) % 500 + 3 for j in range(5 + 7 * i)] for i in range(6)]

    def generate(prompt, k=None):
        r = gateway.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=64,
                             ignore_eos=True, num_speculative_tokens=k), timeout=120)
        return list(r.token_ids), r.spec_stats.num_accepted_tokens
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for p in prompts:
            futures.append(pool.submit(generate, p))
            time.sleep(0.005)
        joined = [f.result() for f in futures]
    assert [t for t, _ in joined] == [generate(p, 0)[0] for p in prompts]
    assert sum(a for _, a in joined) > 0


def test_bridge_carries_rows_and_contract_fires_on_cuda(cuda_cluster):
    _, target, draft = cuda_cluster
    assert_bridge_contract(target, draft, "gpu-contract", [5, 9, 17, 33, 65, 129])
    target.Release(common_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
    draft.Release(common_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
