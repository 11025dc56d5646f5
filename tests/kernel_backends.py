"""The two backends every Triton kernel test runs on, and what they share (a helper of the kernel tests, not a
test file): `interp` runs the kernels on CPU tensors under TRITON_INTERPRET=1 (set here, before triton is
imported, on machines without CUDA), `cuda` compiles them (skipped without CUDA). Import this module before
anything that imports triton."""
import collections
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA and not LATE:
    os.environ["TRITON_INTERPRET"] = "1"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

NO_CUDA = "needs CUDA; this machine has none (the interp cases run the same kernels on CPU)"
BACKENDS = ["interp", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)])]


@pytest.fixture
def launches(monkeypatch):
    """Interpreted kernel launches per kernel name (so a test passes only if the kernel really ran)."""
    counts = collections.Counter()
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return counts


@pytest.fixture(params=BACKENDS)
def dev(request):
    if request.param == "interp":
        if not INTERP:
            pytest.skip("CUDA is here, so this process compiles the kernels (TRITON_INTERPRET=1 runs these)")
        return "cpu"
    if INTERP:
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted in this process, none compiled")
    return "cuda"


def rel(ours, ref) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    return ((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
