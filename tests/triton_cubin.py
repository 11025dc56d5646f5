"""Compile Triton kernels to cubins for a GPU this machine may not have (the interpreter forgives what
the compiler rejects: types, scalar control flow). A helper of the kernel tests, not a test file."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def compile_for_gpu(script: str, arch: int, cache_dir: Path, expected: int) -> None:
    """Run `script` (it compiles kernels for sm_`arch` with Triton's bundled ptxas and prints "compiled"
    per kernel) in a process without TRITON_INTERPRET; assert that all `expected` kernels compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    r = subprocess.run([sys.executable, "-c", script, str(arch)], env=env, capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0 and r.stdout.count("compiled") == expected, r.stdout + r.stderr[-3000:]
