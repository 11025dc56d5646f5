"""DeepSeek-V3.2 sparse attention on the GPU (skipped without CUDA): CUDA-graph replay equals eager steps of a
V3.2 target and draft in both scoring modes (indexer key cache included), and `tandem serve --device cuda`
of a V3.2 checkpoint is lossless: with exact scoring greedy output equals the PyTorch reference model's
(tests/test_dsa.py shows that equals transformers' DeepseekV32), and with deployed (fp8) scoring K = 3
equals K = 0. Checkpoint: make_tiny with models.presets.TINY_V32 (top 16 keys), the MTP drafts re-aimed."""
import pytest
import torch

from models.cuda_graphs import GraphedForward
from models.loader import load_model
from models.model import DraftModel, TargetModel
from models.presets import TINY_V32
from models.runner import greedy_generate, new_cache
from test_gpu_graphs import _steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")

PLAN = [{"a": 9, "b": 21, "c": 40},           # prefill (b, c past index_topk = 16)
        {"a": 4, "b": 4, "c": 4},             # verify K=3
        {"a": 1, "b": 1, "c": 1},             # decode
        {"a": 2, "b": 4, "c": 1},             # mixed accepted rows (draft first step)
        {"a": 4, "b": 4, "c": 4, "d": 7}]     # a new request joins
PROMPTS = [[(13 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 18, 31, 47, 70))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from cluster import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("v32") / "ckpt", seed=5, overrides=TINY_V32)


@pytest.mark.parametrize("scoring", ["exact", "deployed"])
@pytest.mark.parametrize("which", ["target", "draft"])
def test_graph_replay_equals_eager(ckpt, which, scoring, monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION", "triton")
    model = load_model(TargetModel if which == "target" else DraftModel, ckpt, dtype=torch.float32, device="cuda")
    D = model.cfg.hidden_size if which == "draft" else None
    eager_cache, graph_cache = new_cache(model, 64, index_scoring=scoring), new_cache(model, 64, index_scoring=scoring)
    eager = _steps(model, eager_cache, model, PLAN, D)
    graphed = GraphedForward(model, graph_cache, model.cfg.hidden_size, torch.float32, max_model_len=256,
                             max_tokens=32, extra_rows=1 if D else 0)
    replayed = _steps(model, graph_cache, graphed, PLAN, D)
    assert graphed.replays == 4 and graphed.eager == 1           # the 70-token prefill is above max_tokens
    for e, r in zip(eager, replayed):
        torch.testing.assert_close(r, e, rtol=1e-4, atol=1e-4)
    for rid in "abcd":                                            # same indexer keys for every request
        n = eager_cache.length(rid)
        for c in (eager_cache, graph_cache):
            c.slots = torch.tensor([c._tables[rid][p // c.block_size] * c.block_size + p % c.block_size
                                    for p in range(n)], device="cuda")
        got = graph_cache.index_k.view(model.num_cache_layers, -1, 32)[:, graph_cache.slots].float()
        want = eager_cache.index_k.view(model.num_cache_layers, -1, 32)[:, eager_cache.slots].float()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def _served(tmp, ckpt, scoring: str) -> dict:
    from gpu_cluster import serve_cuda
    from tandem.v1 import common_pb2, generate_pb2
    outs = {}
    with serve_cuda(tmp, ["--index-scoring", scoring], model=ckpt) as (gateway, target, _, _):
        info = target.GetInfo(common_pb2.InfoRequest(), timeout=30)
        assert (info.index_topk, info.index_scoring) == (16, scoring)
        for i, prompt in enumerate(PROMPTS):
            for k in (0, 3):
                r = gateway.Generate(generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True,
                    num_speculative_tokens=k), timeout=120)
                outs[i, k] = (list(r.token_ids), r.spec_stats.num_accepted_tokens)
    return outs


def test_served_exact_scoring_equals_the_reference_model(ckpt, tmp_path):
    ref = load_model(TargetModel, ckpt)                            # CPU, fp32: the PyTorch reference
    outs = _served(tmp_path, ckpt, "exact")
    for i, prompt in enumerate(PROMPTS):
        want = greedy_generate(ref, prompt, 24)
        assert outs[i, 0][0] == want and outs[i, 3][0] == want, (i, outs[i, 0], outs[i, 3], want)
    assert sum(outs[i, 3][1] for i in range(len(PROMPTS))) > 0


def test_served_deployed_scoring_is_lossless(ckpt, tmp_path):
    outs = _served(tmp_path, ckpt, "deployed")
    for i in range(len(PROMPTS)):
        assert outs[i, 3][0] == outs[i, 0][0], (i, outs[i, 0], outs[i, 3])
    assert sum(outs[i, 3][1] for i in range(len(PROMPTS))) > 0
