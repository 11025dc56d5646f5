"""CUDA graphs (models/cuda_graphs.py): replayed steps equal eager steps with the same kernels, padding
never touches a real request's cache, and a step no bucket fits runs eagerly. Skipped without CUDA."""
import pytest
import torch

from models.cuda_graphs import GraphedForward
from models.loader import load_model
from models.model import DraftModel, TargetModel
from models.runner import new_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cluster import make_checkpoint
    path = make_checkpoint(tmp_path_factory.mktemp("graphs"), seed=3)
    return (load_model(TargetModel, path, dtype=torch.float32, device="cuda"),
            load_model(DraftModel, path, dtype=torch.float32, device="cuda"))


def _steps(model, cache, fn, plan, hidden_size=None, ids_in_layout=True):
    """Run the same schedule of steps: plan = list of {request: n new tokens}; returns outputs. ids_in_layout: the
    input ids travel with the step's layout (batch.input_ids), else as a tensor of their own."""
    g = torch.Generator().manual_seed(0)
    outs = []
    for step in plan:
        for r in step:
            if r not in cache:
                cache.allocate(r)
        n = sum(step.values())
        tokens = torch.randint(3, model.cfg.vocab_size, (n,), generator=g)
        batch = cache.prepare(list(step), list(step.values()), tokens.tolist() if ids_in_layout else None)
        tokens = batch.input_ids if ids_in_layout else tokens.cuda()
        with torch.inference_mode():
            if hidden_size:
                rows = torch.randn(n, hidden_size, generator=g).cuda()
                outs.append(fn(tokens, rows, batch, cache, step=0).clone())
            else:
                outs.append(fn(tokens, batch, cache).clone())
    return outs


PLAN = [{"a": 9, "b": 11, "c": 20},           # prefill: 40 tokens
        {"a": 4, "b": 4, "c": 4},             # verify K=3: 12 tokens of 3 requests
        {"a": 1, "b": 1, "c": 1},             # decode
        {"a": 2, "b": 4, "c": 1},             # mixed accepted rows (draft first step)
        {"a": 4, "b": 4, "c": 4, "d": 7}]     # a new request joins


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("which", ["target", "draft"])
def test_graph_replay_equals_eager(tiny, which, staged, monkeypatch):
    """staged: the cache lays each step out into its bucket's buffers (as the engines run); else the step is laid out
    on its own and the replay lays it out again into them (ids copied in)."""
    monkeypatch.setenv("TANDEM_ATTENTION", "triton")
    model = tiny[0] if which == "target" else tiny[1]
    D = model.cfg.hidden_size if which == "draft" else None
    eager_cache, graph_cache = new_cache(model, 64), new_cache(model, 64)
    eager = _steps(model, eager_cache, model, PLAN, D, ids_in_layout=False)
    graphed = GraphedForward(model, graph_cache, model.cfg.hidden_size, torch.float32, max_model_len=256,
                             max_tokens=32, extra_rows=1 if D else 0)
    if not staged:
        graph_cache.staging = None
    replayed = _steps(model, graph_cache, graphed, PLAN, D, ids_in_layout=staged)
    assert graphed.replays == 4 and graphed.eager == 1           # the 40-token prefill is above max_tokens
    for e, r in zip(eager, replayed):
        torch.testing.assert_close(r, e, rtol=1e-4, atol=1e-4)
    for layer in range(model.num_cache_layers):                   # same cache contents for every request
        for rid in "abcd":
            n = eager_cache.length(rid)
            slots = lambda c: torch.tensor([c._tables[rid][p // c.block_size] * c.block_size + p % c.block_size
                                            for p in range(n)], device="cuda")
            torch.testing.assert_close(graph_cache.ckv[layer].view(-1, graph_cache.ckv.shape[-1])[slots(graph_cache)],
                                       eager_cache.ckv[layer].view(-1, eager_cache.ckv.shape[-1])[slots(eager_cache)],
                                       rtol=1e-4, atol=1e-4)
