"""Every Triton kernel (kernels/triton_*.py) equals its PyTorch reference, exactly, on many random cases.

Two backends per test: `interp` runs the kernels on CPU tensors under TRITON_INTERPRET=1 (CI on CPU),
`cuda` runs them compiled on the GPU (skipped without CUDA). One process holds one mode (Triton
decides at import), so without CUDA this module sets TRITON_INTERPRET=1 before triton is imported
and keeps it set (triton reads it again at launch); with CUDA the kernels compile and the interp cases
skip, unless TRITON_INTERPRET=1 is given (then the cuda cases skip). Each interp test counts the
interpreted launches, so a test passes only if the kernel really ran, not the reference.
"""
import collections
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"   # too late to interpret
if not CUDA and not LATE:                 # before triton's and the kernels' @triton.jit run: interpreted
    os.environ["TRITON_INTERPRET"] = "1"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import dispatch, rows as ref_rows, speculative as ref_spec  # noqa: E402
from kernels import triton_rows, triton_speculative  # noqa: E402
from triton_cubin import compile_for_gpu  # noqa: E402

MODULES = (triton_speculative, triton_rows)
NO_CUDA = "needs CUDA; this machine has none (the interp cases run the same kernels on CPU)"
BACKENDS = ["interp", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)])]


def _interpreted(monkeypatch) -> collections.Counter:
    """Count interpreted kernel launches per kernel name (the kernels are interpreted: INTERP)."""
    for mod in MODULES:
        for name, obj in vars(mod).items():
            assert not isinstance(obj, JITFunction), f"{mod.__name__}.{name} was compiled, not interpreted"
    launches = collections.Counter()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return launches


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """-> (device, launches): launches counts interpreted kernel runs (None on CUDA)."""
    if request.param == "interp":
        if not INTERP and not CUDA:
            pytest.fail("triton was imported before this module without TRITON_INTERPRET=1: rerun with it set")
        if not INTERP:
            pytest.skip("CUDA is here, so this process compiles the kernels; the interpreter cases run on "
                        "CPU-only machines (CI), or here with TRITON_INTERPRET=1")
        return "cpu", _interpreted(monkeypatch)
    if INTERP:
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted in this process, none compiled")
    return "cuda", None


def same(ours, ref):
    """Tuples of tensors equal exactly: shape, dtype, values (compared on the CPU)."""
    for o, r in zip(ours, ref, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
        assert torch.equal(o.cpu(), r.cpu()), f"\nkernel    {o.cpu()}\nreference {r.cpu()}"


def ran(launches, kernel: str):
    assert launches is None or launches[kernel] > 0, f"{kernel} never ran: {dict(launches)}"


def ragged_drafts(g, B, K):
    """num_drafts [B] in [0, K], with 0 and K always present when B >= 2."""
    k = torch.randint(0, K + 1, (B,), generator=g)
    if B >= 2:
        k[0], k[1] = 0, K
    return k


def norm(x):
    x = torch.where(x.sum(-1, keepdim=True) > 0, x, torch.ones_like(x))   # no all-zero rows
    return x / x.sum(-1, keepdim=True)


KINDS = ["random", "onehot", "p_is_q", "p_below_q", "ties"]
GPU_VOCABS = [1, 3, 100, 1000, 1024, 1025, 3000, 4097]   # few: each block count / size is a compile


def spec_case(g, B, K, V, kind):
    """A random rejection-sampling input: p [B, K+1, V] (zero past each request's k, as the engine
    masks it), q [B, K, V], drafts sampled from q (so acceptance varies), u [B, K], E [B, V]."""
    k = ragged_drafts(g, B, K)
    p = norm(torch.rand(B, K + 1, V, generator=g) ** 6 * (torch.rand(B, K + 1, V, generator=g) < 0.7))  # sparse
    q = norm(torch.rand(B, K, V, generator=g) ** 6)
    e = torch.empty(B, V).exponential_(generator=g)
    if kind == "onehot":                   # greedy target and draft: one-hot rows, often equal
        p = torch.nn.functional.one_hot(torch.randint(0, min(V, 3), (B, K + 1), generator=g), V).float()
        q = torch.nn.functional.one_hot(torch.randint(0, min(V, 3), (B, K), generator=g), V).float()
    elif kind == "p_is_q":                 # nothing is ever rejected
        q = p[:, :K].clone()
    elif kind == "p_below_q":              # p = q / 2 (unnormalized): rejections whose residual is all
        p[:, :K] = q / 2                   # zero, so the recovered token falls back to sampling p
    elif kind == "ties":                   # E = 1 and flat p: every score ties, first index wins
        p, e = torch.full((B, K + 1, V), 1.0 / V), torch.ones(B, V)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K) if K else torch.zeros(B, 0).long()
    p = p * (torch.arange(K + 1)[None, :] <= k[:, None])[..., None]
    return p, q, drafts, k, torch.rand(B, K, generator=g), e


def test_reference_shapes_with_no_drafts():
    # K = 0 (a K = 0 baseline batch): emitted is [B, 1], the bonus sampled from p[:, 0]
    p = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    acc, out = ref_spec.rejection_sample(p, torch.zeros(2, 0, 3), torch.zeros(2, 0).long(), torch.zeros(2).long(),
                                         torch.zeros(2, 0), torch.ones(2, 3))
    assert acc.tolist() == [0, 0] and out.tolist() == [[1], [2]]


def test_greedy_accept_matches_reference(backend):
    """The argmax of each verified position's logit row (ties: the first index, as torch.argmax) and the longest
    prefix of drafts equal to it, in two launches: equal to argmax + kernels.speculative.greedy_verify."""
    dev, launches = backend
    g = torch.Generator().manual_seed(0)
    for trial in range(60 if dev == "cpu" else 400):
        B, K = int(torch.randint(1, 7, (1,), generator=g)), trial % 6                 # K = 0 .. 5
        V = (3, 50, 1024, 2500, 4099)[trial % 5]                                         # one chunk and several
        k = ragged_drafts(g, B, K)
        N = int((k + 1).sum())
        logits = torch.randint(0, 4, (N, V), generator=g).float()                        # ties in every row
        starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), k[:-1] + 1]), 0)
        rows = torch.minimum(starts[:, None] + torch.arange(K + 1)[None, :], torch.tensor(N - 1))
        target = logits.argmax(-1)[rows]
        drafts = torch.where(torch.rand(B, K, generator=g) < 0.8, target[:, :K], torch.randint(0, V, (B, K), generator=g))
        got = triton_speculative.greedy_accept_triton(logits.to(dev), rows.to(dev), drafts.to(dev), k.to(dev))
        same(got, ref_spec.greedy_accept(logits, rows, drafts, k))
        assert torch.equal(got[1].cpu(), target)
    ran(launches, "_greedy_accept_kernel")


@pytest.mark.parametrize("kind", KINDS)
def test_rejection_sample_matches_reference(backend, kind):
    dev, launches = backend
    g = torch.Generator().manual_seed(KINDS.index(kind))
    for trial in range(40 if dev == "cpu" else 150):
        B, K = int(torch.randint(1, 6, (1,), generator=g)), trial % 5                 # K = 0 .. 4
        V = int(torch.randint(1, 300, (1,), generator=g)) if dev == "cpu" else GPU_VOCABS[trial % 8]
        block_v = 64 if dev == "cpu" else 1024                                          # several V blocks
        args = spec_case(g, B, K, V, kind)
        same(triton_speculative.rejection_sample_triton(*(a.to(dev) for a in args), block_v=block_v),
             ref_spec.rejection_sample(*args))
    ran(launches, "_rejection_sample_kernel")


def test_rejection_sample_large_vocab(backend):
    dev, launches = backend
    g = torch.Generator().manual_seed(7)
    V = 1000 if dev == "cpu" else 129280                  # DeepSeek-V3's vocab on the GPU
    for seed_kind in ["random", "onehot", "p_is_q"]:
        args = spec_case(g, 4, 3, V, seed_kind)
        same(triton_speculative.rejection_sample_triton(*(a.to(dev) for a in args)), ref_spec.rejection_sample(*args))
    ran(launches, "_rejection_sample_kernel")


def test_rejection_sample_edge_cases(backend):
    dev, launches = backend
    V = 5
    hot = torch.nn.functional.one_hot(torch.tensor(3), V).float()
    p, q = hot.expand(3, 3, V).clone(), hot.expand(3, 2, V).clone()
    q[2, 0] = torch.nn.functional.one_hot(torch.tensor(1), V).float()      # request 2: draft never right
    drafts = torch.tensor([[3, 3], [3, 3], [1, 3]])
    cases = [(torch.tensor([2, 0, 2]), torch.rand(3, 2)),                   # all accepted / none drafted / rejected
             (torch.tensor([1, 2, 1]), torch.ones(3, 2)),                   # u = 1: accept only p >= q
             (torch.tensor([2, 2, 2]), torch.zeros(3, 2))]                  # u = 0: accept where p >= 0
    expect = [[[3, 3, 3], [3, -1, -1], [3, -1, -1]],                        # (emitted per request)
              [[3, 3, -1], [3, 3, 3], [3, -1, -1]],
              [[3, 3, 3], [3, 3, 3], [1, 3, 3]]]                            # u = 0 accepts the p = 0 draft too
    for (k, u), want in zip(cases, expect):
        args = (p, q, drafts, k, u, torch.empty(3, V).exponential_())
        acc, out = triton_speculative.rejection_sample_triton(*(a.to(dev) for a in args))
        same((acc, out), ref_spec.rejection_sample(*args))
        assert out.tolist() == want and acc.tolist() == [r.index(-1) - 1 if -1 in r else 2 for r in want]
    # an empty batch launches nothing and returns empty outputs
    e = triton_speculative.rejection_sample_triton(p[:0].to(dev), q[:0].to(dev), drafts[:0].to(dev),
                                                   k[:0].to(dev), u[:0].to(dev), torch.ones(0, V, device=dev))
    assert e[0].shape == (0,) and e[1].shape == (0, 3)
    ran(launches, "_rejection_sample_kernel")


def test_sp_rows_match_reference(backend):
    dev, launches = backend
    g = torch.Generator().manual_seed(12)
    for trial in range(20 if dev == "cpu" else 80):
        N, D = int(torch.randint(0, 40, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        tp = trial % 4 + 1 if dev == "cpu" else trial % 8 + 1
        x = torch.randn(N, D, generator=g)
        xd = x.to(dev)
        same([triton_rows.pad_rows_triton(xd, tp)], [ref_rows.pad_rows(x, tp)])
        for rank in range(tp):
            same([triton_rows.pad_shard_rows_triton(xd, tp, rank)], [ref_rows.pad_shard_rows(x, tp, rank)])
        gathered = ref_rows.pad_rows(x, tp)
        same([triton_rows.trim_rows_triton(gathered.to(dev), N)], [ref_rows.trim_rows(gathered, N)])
    # out=: write into a persistent buffer (a strided view of a larger one)
    buf = torch.full((8, 2, 5), 7.0, device=dev)
    out = triton_rows.pad_rows_triton(torch.ones(3, 5, device=dev), 4, out=buf[4:, 1])
    assert out.data_ptr() == buf[4:, 1].data_ptr() and buf[4:, 1].sum(-1).tolist() == [5, 5, 5, 0]
    assert (buf[:4] == 7).all() and (buf[4:, 0] == 7).all()                # nothing else touched
    ran(launches, "_row_window_kernel")


@pytest.mark.skipif(not INTERP, reason="needs the interpreter (a CPU-only machine, or TRITON_INTERPRET=1)")
def test_dispatch_picks_reference_on_cpu(monkeypatch):
    launches = _interpreted(monkeypatch)
    g = torch.Generator().manual_seed(3)
    args = spec_case(g, 3, 2, 50, "random")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    same(dispatch.rejection_sample(*args), ref_spec.rejection_sample(*args))           # auto, CPU: reference
    monkeypatch.setenv(dispatch.ENV, "reference")
    same([dispatch.pad_rows(torch.ones(3, 4), 2)], [ref_rows.pad_rows(torch.ones(3, 4), 2)])
    assert not launches
    monkeypatch.setenv(dispatch.ENV, "triton")                                          # forced, interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    same(dispatch.rejection_sample(*args), ref_spec.rejection_sample(*args))
    greedy = (args[0][:, 0], torch.arange(args[2].shape[0])[:, None], args[2][:, :0], args[3].clamp(max=0))
    same(dispatch.greedy_accept(*greedy), ref_spec.greedy_accept(*greedy))
    assert launches["_rejection_sample_kernel"] == 1 and launches["_greedy_accept_kernel"] == 1
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.greedy_accept(*greedy)
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="TANDEM_KERNELS"):
        dispatch.greedy_accept(*greedy)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
def test_dispatch_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    calls = []
    real = triton_speculative.rejection_sample_triton
    monkeypatch.setattr(triton_speculative, "rejection_sample_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = spec_case(torch.Generator().manual_seed(4), 8, 3, 1000, "random")
    same(dispatch.rejection_sample(*(a.cuda() for a in args)), ref_spec.rejection_sample(*args))
    assert calls == [1]
    monkeypatch.setenv(dispatch.ENV, "reference")
    dispatch.rejection_sample(*(a.cuda() for a in args))
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason=NO_CUDA)
def test_rejection_kernel_is_lossless_on_cuda():
    # the first emitted token follows p[0] whatever q is: 400k draws through the compiled kernel
    torch.manual_seed(0)
    V, n, dev = 50, 400_000, "cuda"
    p, q = norm(torch.rand(2, V, device=dev) ** 3), norm(torch.rand(1, V, device=dev) ** 3)
    drafts = torch.multinomial(q[0], n, replacement=True)[:, None]
    acc, out = triton_speculative.rejection_sample_triton(
        p.expand(n, 2, V), q.expand(n, 1, V), drafts, torch.ones(n, dtype=torch.long, device=dev),
        torch.rand(n, 1, device=dev), torch.empty(n, V, device=dev).exponential_())
    first = torch.bincount(out[:, 0], minlength=V).float() / n
    assert (first - p[0]).abs().sum() / 2 < 0.01
    assert abs(acc.float().mean() - torch.minimum(p[0], q[0]).sum()) < 0.01


COMPILE = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_rows as tr, triton_speculative as ts
# kernel -> (pointer types other than *i64, constexpr values); strides i64, other scalars i32
KERNELS = [(ts._chunk_max_kernel, dict(x_ptr="*fp32", val_ptr="*fp32"), dict(CHUNK=1024)),
           (ts._greedy_accept_kernel, dict(val_ptr="*fp32"), dict(BLOCK_K=8, BLOCK_C=128)),
           (ts._rejection_sample_kernel, dict.fromkeys(["p_ptr", "q_ptr", "u_ptr", "e_ptr"], "*fp32"),
            dict(BLOCK_K=4, BLOCK_V=1024, V_BLOCKS=127, HAS_Q=True)),
           (ts._rejection_sample_kernel, dict.fromkeys(["p_ptr", "q_ptr", "u_ptr", "e_ptr"], "*fp32"),
            dict(BLOCK_K=1, BLOCK_V=64, V_BLOCKS=1, HAS_Q=False)),
           (tr._row_window_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK_R=16, BLOCK_D=256))]
for fn, ptrs, consts in KERNELS:
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "*i64") if a.endswith("_ptr") else
           "i64" if a.startswith("s_") else "i32" for a in fn.arg_names}
    src = ASTSource(fn, sig, {(fn.arg_names.index(a),): v for a, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", int(sys.argv[1]), 32), options=dict(num_warps=4))
    assert k.asm["cubin"], fn.__name__
    print("compiled", fn.__name__)
'''


@pytest.mark.parametrize("arch", [90])                                      # H200: sm_90
def test_kernels_compile_for_the_gpu_without_one(tmp_path, arch):
    compile_for_gpu(COMPILE, arch, tmp_path, expected=5)
