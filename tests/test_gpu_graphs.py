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


def compiled_variants() -> dict[str, int]:
    """Kernel variants compiled so far in this process, per Triton function of kernels/ (its per-device caches)."""
    import sys
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    out = {}
    for name, mod in list(sys.modules.items()):
        for attr, v in (vars(mod).items() if name.startswith("kernels.") else ()):
            f = v.fn if isinstance(v, Autotuner) else v
            if isinstance(f, JITFunction):
                out[f"{name}.{attr}"] = sum(len(c[0]) for c in f.device_caches.values())
    return out


def test_no_kernel_compiles_after_start(tmp_path):
    """After the engine's start (graphs captured, the eager size classes run) and one small step, steps of new shapes
    compile nothing: eager steps past the graphs whose attention is the decode form (no request brings more than 64
    query rows) over tables of other widths, so other key-split counts, and a Verify with prompts riding it. Such a
    first step compiled the attention kernel for 0.9 s mid-serving (BENCHMARKS.md, twenty-fifth session)."""
    from cluster import make_checkpoint
    from services.launch import build_engine
    from services.sampling import Sampling
    from services.target.engine import TargetEngine
    te = build_engine(TargetEngine, TargetModel, str(make_checkpoint(tmp_path, seed=4)), "cuda", torch.bfloat16,
                      num_blocks=1024, graph_batch=8)
    g = torch.Generator().manual_seed(0)
    new = lambda tag, n, k: [(f"{tag}{i}", torch.randint(3, 500, (k,), generator=g).tolist(), Sampling())
                             for i in range(n)]
    drafts = lambda ids, k: [(r, [te.requests[r].pending_token] * k, None) for r in ids]
    te.prefill(new("s", 1, 10))
    te.verify(drafts(["s0"], 2))                            # a first (graphed) step of each call
    before = compiled_variants()
    te.prefill(new("a", 12, 50))                            # 600 tokens of 12 prompts <= 64: eager, one split
    te.prefill(new("b", 2, 300))                            # prompts past 64 rows: the prefill form
    te.verify(drafts([f"a{i}" for i in range(12)] + ["b0", "b1"], 3))       # tables 20 blocks wide: 3 splits
    te.prefill(new("c", 1, 1500))
    ids = [f"a{i}" for i in range(12)] + ["b0", "b1", "c0"]
    te.verify_and_prefill(drafts(ids, 3), None, new("d", 7, 60))            # 94 blocks: 12 splits, prompts riding
    grown = {k: n - before.get(k, 0) for k, n in compiled_variants().items() if n != before.get(k, 0)}
    assert not grown, f"kernels compiled after the start: {grown}"


class _CudaFinalizer:
    """Cyclic garbage whose finalizer calls CUDA, as a closed bridge generation's IPC mapping or events do, and
    leaves another behind: a collection always finds one (garbage made once would be collected by the eager steps
    before the capture, and the test could not fail)."""
    live = True

    def __init__(self):
        self.me = self

    def __del__(self):
        torch.cuda.current_stream().synchronize()      # not permitted on a capturing stream
        if _CudaFinalizer.live:
            _CudaFinalizer()


def test_no_garbage_collection_during_a_capture(tiny):
    """A collection during a capture runs finalizers on the capturing thread (torch no longer collects before one):
    with garbage like the bridge tests leave and a collection due at every allocation, graphs still capture
    (models/cuda_graphs.gc_paused) and replay what the eager step computes. Without the pause: 'operation failed due
    to a previous error during capture' (seen on an H100 after tests/test_bridge_generations.py)."""
    import gc
    model = tiny[0]
    eager = _steps(model, new_cache(model, 64), model, PLAN[:2])
    cache = new_cache(model, 64)
    graphed = GraphedForward(model, cache, model.cfg.hidden_size, torch.float32, max_model_len=256, max_tokens=32)
    threshold = gc.get_threshold()
    _CudaFinalizer.live = True
    _CudaFinalizer()
    gc.set_threshold(1)
    try:
        replayed = _steps(model, cache, graphed, PLAN[:2])     # step 2 (12 tokens) is captured
    finally:
        _CudaFinalizer.live = False
        gc.set_threshold(*threshold)
        gc.collect()
    for a, b in zip(eager, replayed):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_captures_on_one_stream_share_their_memory(tiny, monkeypatch):
    """Every capture of a GPU runs on one stream (models/cuda_graphs.capture_stream): the graphs' shared pool then
    reuses what an earlier capture freed. Captured on a new stream each, the same graphs kept ~1 GB more allocated on
    each V2-Lite service (BENCHMARKS.md, forty-third session); here the two ways are measured side by side."""
    import models.cuda_graphs as cg
    model = tiny[0]

    def grown(stream_for) -> tuple[int, int]:
        monkeypatch.setattr(cg, "capture_stream", stream_for)
        cache = new_cache(model, 64)
        graphed = GraphedForward(model, cache, model.cfg.hidden_size, torch.float32, max_model_len=256, max_tokens=32)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        n = graphed.warmup(max_batch=8)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, n

    one, n_one = grown(cg.capture_stream)
    fresh, n_fresh = grown(lambda device: torch.cuda.Stream(device))
    assert n_one == n_fresh >= 8
    print(f"{n_one} captures: {one / 2**20:.2f} MiB allocated on one stream, {fresh / 2**20:.2f} MiB on fresh streams")
    assert one < 0.6 * fresh, f"{n_one} captures on one stream kept {one} bytes allocated, on fresh streams {fresh}"
