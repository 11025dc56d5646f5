"""GPU end to end: `tandem serve --device cuda` (target on cuda:0, draft on cuda:1 over the NCCL bridge
when two GPUs are present; one GPU: both on cuda:0 over the CUDA IPC bridge). Skipped without CUDA."""
import grpc
import pytest
import torch

from cluster import serve_cuda
from tandem.v1 import draft_pb2, generate_pb2, rows_pb2, target_pb2

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
    prompt = [5, 9, 17, 33, 65, 129]
    resp = target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
        request_id="gpu-contract", prompt_token_ids=prompt)], return_hidden_rows=True,
        transport=rows_pb2.TRANSPORT_BRIDGE), timeout=60)
    rows = resp.hidden_rows
    assert rows.transport == rows_pb2.TRANSPORT_BRIDGE and rows.num_rows == len(prompt)
    item = draft_pb2.ProposeItem(request_id="gpu-contract", new_token_ids=prompt + [resp.first_token_ids[0]],
                                 num_draft_tokens=2, position=0)
    bad = draft_pb2.ProposeRequest(items=[item], hidden_rows=[rows])
    bad.hidden_rows[0].rows_per_request[0] = len(prompt) - 1
    bad.hidden_rows[0].num_rows = len(prompt) - 1
    with pytest.raises(grpc.RpcError) as e:
        draft.Propose(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(len(prompt)) in e.value.details() and str(len(prompt) - 1) in e.value.details()
    target.Release(target_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
    draft.Release(target_pb2.ReleaseRequest(request_ids=["gpu-contract"]), timeout=10)
