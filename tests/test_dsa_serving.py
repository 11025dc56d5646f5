"""DeepSeek-V3.2 served end to end (CPU, real processes): a checkpoint written by transformers'
DeepseekV32ForCausalLM (+ an MTP layer with its own indexer, index_topk 8) served by target, draft and
gateway. Greedy output equals transformers' own greedy decoding at K = 0, at K = 3, and at K = 3 with a
`--tp 2 --ep 2 --sequence-parallel` target and a `--tp 2 --sequence-parallel` draft, with identical acceptance
in both layouts; GetInfo reports the sparse attention; and a tp-2 SP draft with
TANDEM_FAULT=skip_sp_gather on this V3.2 model fails loudly, naming both row counts."""
from __future__ import annotations

import math

import grpc
import pytest

from cluster import Cluster, serve_module
from dsa_checkpoint import hf_greedy, make_v32_checkpoint
from tandem.v1 import common_pb2, generate_pb2 as gen

pytestmark = pytest.mark.slow

RPC_TIMEOUT = 120
SP2 = ["--tp", "2", "--sequence-parallel"]
PROMPTS = {f"len{n}": [(11 * i + 5 * n) % 500 + 3 for i in range(n)] for n in (3, 19, 40)}
NEW = 16


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return make_v32_checkpoint(tmp_path_factory.mktemp("v32") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def mesh(v32, tmp_path_factory, request):
    targets = [{"name": "target-tp1"}, {"name": "target-tp2-ep2-sp", "args": SP2 + ["--ep", "2"]}]
    drafts = [{"name": "draft-tp1"}, {"name": "draft-tp2-sp", "args": SP2},
              {"name": "draft-fault", "args": SP2, "env": {"TANDEM_FAULT": "skip_sp_gather"}}]
    gateways = [{"name": "gw-tp1", "target": 0, "draft": 0}, {"name": "gw-tp2-sp", "target": 1, "draft": 1},
                {"name": "gw-fault", "target": 0, "draft": 2}]
    with Cluster(v32[0], k=3, hidden_transport="inline", targets=targets, drafts=drafts, gateways=gateways,
                 log_dir=tmp_path_factory.mktemp("v32-logs")) as c:
        yield from serve_module(c, request)


def generate(stub, prompt: list[int], k: int):
    r = gen.GenerateRequest(max_tokens=NEW, ignore_eos=True, num_speculative_tokens=k)
    r.token_ids.ids.extend(prompt)
    msgs = list(stub.GenerateStream(r, timeout=RPC_TIMEOUT))
    s = msgs[-1].spec_stats
    return [t for m in msgs for t in m.token_ids], (s.num_drafts, s.num_accepted_tokens, list(s.accepted_per_position))


def test_served_greedy_equals_transformers_at_k0_k3_and_tp2_sp(v32, mesh):
    hf = v32[1]
    tp1, sp = mesh.gateways[0].stub, mesh.gateways[1].stub
    accepted = 0
    for name, prompt in PROMPTS.items():
        want = hf_greedy(hf, prompt, NEW)
        k0, _ = generate(tp1, prompt, 0)
        k3, stats = generate(tp1, prompt, 3)
        k3_sp, stats_sp = generate(sp, prompt, 3)
        assert k0 == want, f"{name}: K=0 differs from transformers' DeepseekV32"
        assert k3 == want, f"{name}: K=3 differs from transformers' DeepseekV32"
        assert k3_sp == want, f"{name}: K=3 with TP2 / EP2 / SP differs from transformers' DeepseekV32"
        assert stats_sp == stats and stats[0] > 0, f"{name}: acceptance differs across layouts {stats} {stats_sp}"
        accepted += stats[1]
    assert accepted > 0, "no draft was ever accepted: rollback of the indexer keys went untested"


def test_getinfo_reports_sparse_attention(mesh):
    info = mesh.targets[0].GetInfo(common_pb2.InfoRequest(), timeout=30)
    assert (info.index_topk, info.index_scoring) == (8, "exact")
    info = mesh.drafts[1].GetInfo(common_pb2.InfoRequest(), timeout=30)
    assert (info.index_topk, info.index_scoring) == (8, "exact")


def test_skip_sp_gather_on_v32_fails_loudly(mesh):
    prompt = PROMPTS["len19"]
    with pytest.raises(grpc.RpcError) as e:
        generate(mesh.gateways[2].stub, prompt, 3)
    T = len(prompt)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()      # the cluster's fault, not the client's
    assert f"returned {math.ceil(T / 2)} rows for {T} input tokens (expected {T})" in e.value.details()
