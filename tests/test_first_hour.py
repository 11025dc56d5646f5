"""The user's first hour (issue 19, item 6): what `make run` and `make test` install, the torch build a
machine gets, and documentation that points only inside the repository."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", *sorted(p.relative_to(REPO).as_posix()
                                                            for p in (REPO / "docs").glob("*.md"))]


def make_dry_run(target: str, tmp_path: Path, gpu: bool) -> str:
    """`make -n TARGET` for a fresh venv, on a machine with (a stand-in nvidia-smi that lists a GPU) or
    without an NVIDIA GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("make", "python3", "sh", "test"):
        if (path := shutil.which(tool)) and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(path)
    smi = bin_dir / "nvidia-smi"
    if gpu:
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
        smi.chmod(0o755)
    elif smi.exists():
        smi.unlink()
    env = {**os.environ, "PATH": str(bin_dir)}
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_run_installs_serving_only_and_make_test_adds_the_test_tools(tmp_path):
    run, test = make_dry_run("run", tmp_path, gpu=False), make_dry_run("test", tmp_path, gpu=False)
    assert "-e ." in run and ".[test]" not in run, run
    assert ".[test]" in test, test


def test_a_machine_without_a_gpu_gets_the_cpu_build_of_torch(tmp_path):
    cpu = make_dry_run("install", tmp_path, gpu=False)
    assert re.search(r'--no-deps --extra-index-url https://download.pytorch.org/whl/cpu .*"torch==[\d.]+\+cpu"', cpu), cpu
    assert "torch.version.cuda is None" in cpu, cpu                  # and the install checks what it got
    gpu = make_dry_run("install", tmp_path, gpu=True)
    assert re.search(r'"torch==[\d.]+"', gpu) and "whl/cpu" not in gpu, gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine may hold a CUDA build")
def test_this_cpu_machine_holds_a_cpu_build_of_torch():
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build on a machine without CUDA"


@pytest.mark.parametrize("doc", DOCS)
def test_documents_point_only_inside_the_repository(doc):
    text = (REPO / doc).read_text()
    outside = sorted(set(re.findall(r"\.\./[\w./-]+", text)))
    assert not outside, f"{doc} points outside the repository: {outside}"
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if not re.match(r"[a-z]+://|mailto:", target):
            assert (REPO / Path(doc).parent / target).exists(), f"{doc} links to {target}, which is not in the repository"
