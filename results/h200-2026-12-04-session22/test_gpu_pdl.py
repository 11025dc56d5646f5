"""Programmatic dependent launch (kernels/pdl.py): the decode step's Triton kernels may start while the kernel before
them finishes, and wait for it first. Launched that way inside CUDA graphs they must give the same bits as launched
plainly: a kernel that read its input before the kernel writing it had finished would show here. The rule itself
(off on CPU and by TANDEM_PDL=0) is checked on any machine."""
import pytest
import torch

from kernels import pdl

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (PDL); this machine has none")


def test_pdl_is_off_on_cpu_and_by_env(monkeypatch):
    assert pdl.launch(torch.zeros(1)) == {"PDL": False}                  # the interpreter launches plainly
    if HOPPER:
        assert pdl.launch(torch.zeros(1, device="cuda")) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv(pdl.ENV, "0")
        assert pdl.launch(torch.zeros(1, device="cuda")) == {"PDL": False}


def _replays(monkeypatch, on: bool, fn, inputs):
    """fn over each of inputs inside one CUDA graph, with PDL on or off at capture -> the outputs after a replay."""
    monkeypatch.setenv(pdl.ENV, "1" if on else "0")
    static = [t.clone() for t in inputs[0]]
    fn(*static)                                                           # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    got = []
    for args in inputs:
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        got.append([o.clone() for o in (out if isinstance(out, (list, tuple)) else [out])])
    torch.cuda.synchronize()
    return got


@needs_hopper
@pytest.mark.gpu
def test_graph_replay_of_a_target_step_with_pdl_equals_without(tmp_path, monkeypatch):
    from cluster import make_checkpoint
    from models.cuda_graphs import GraphedForward
    from models.loader import load_model
    from models.model import TargetModel
    from models.runner import new_cache
    monkeypatch.setenv("TANDEM_ATTENTION", "triton")
    model = load_model(TargetModel, make_checkpoint(tmp_path, seed=4), dtype=torch.bfloat16, device="cuda")
    plan = [{"a": 9, "b": 11}, {"a": 4, "b": 4}, {"a": 1, "b": 1}, {"a": 2, "b": 4}, {"a": 1, "b": 1}]
    runs = []
    for on in (False, True):
        monkeypatch.setenv(pdl.ENV, "1" if on else "0")
        cache = new_cache(model, 64)
        graphed = GraphedForward(model, cache, model.cfg.hidden_size, torch.bfloat16, max_model_len=256,
                                 max_tokens=32)
        g, outs = torch.Generator().manual_seed(0), []
        for step in plan:
            for r in step:
                if r not in cache:
                    cache.allocate(r)
            batch = cache.prepare(list(step), list(step.values()))
            tokens = torch.randint(3, model.cfg.vocab_size, (batch.num_tokens,), generator=g).cuda()
            with torch.inference_mode():
                outs.append(graphed(tokens, batch, cache).clone())
        assert graphed.replays == len(plan)
        owned = torch.tensor([b for r in ("a", "b") for b in cache._tables[r]], device="cuda")
        runs.append((outs, cache.ckv[:, owned].clone(), cache.kpe[:, owned].clone()))   # not the padding's scratch
    (plain, ckv0, kpe0), (early, ckv1, kpe1) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, early))
    assert torch.equal(ckv0, ckv1) and torch.equal(kpe0, kpe1)


@needs_hopper
@pytest.mark.gpu
def test_fp8_linear_and_moe_with_pdl_in_a_graph_equal_without(monkeypatch):
    from kernels.fp8 import quantize_weight
    from kernels.triton_fp8 import fp8_linear_triton
    from kernels.triton_fp8_moe import fused_moe_fp8_triton
    g = torch.Generator(device="cuda").manual_seed(2)
    D, I, E, k = 1024, 512, 16, 4
    w, s = quantize_weight(torch.randn(3072, D, device="cuda", generator=g) * 0.02)
    q = [quantize_weight(torch.randn(2 * I, D, device="cuda", generator=g) * 0.02) for _ in range(E)]
    w13, s13 = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])
    q = [quantize_weight(torch.randn(D, I, device="cuda", generator=g) * 0.02) for _ in range(E)]
    w2, s2 = torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])

    def step(x, rw, ids):           # a projection feeding the MoE feeding another projection: kernels back to back
        h = fp8_linear_triton(x, w, s)[:, :D]
        y = fused_moe_fp8_triton(h.contiguous(), w13, s13, w2, s2, rw, ids, 0)
        return fp8_linear_triton(y, w, s)

    for n in (1, 4, 32):
        inputs = [(torch.randn(n, D, device="cuda", generator=g).bfloat16(),
                   torch.rand(n, k, device="cuda", generator=g),
                   torch.rand(n, E, device="cuda", generator=g).argsort(1)[:, :k].contiguous()) for _ in range(4)]
        plain, early = (_replays(monkeypatch, on, step, inputs) for on in (False, True))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, early)), n
        assert not torch.equal(plain[0][0], plain[1][0])                  # the replays saw their own inputs
