"""`tandem corpus` (tandem/corpus.py) on a fake stdlib and one small installed distribution: exact copies of a stdlib
file and near-copies either way are dropped, the rest kept under extra/<distribution>/, the manifest counts them,
and the archive is the same bytes on every build."""
import importlib.metadata as md
import io
import json
import tarfile
from pathlib import Path

import pytest

from tandem import corpus

DIST = "iniconfig"      # a small pure-Python dependency of pytest: __init__.py, _parse.py, _version.py, exceptions.py


def source(name: str) -> str:
    dist = md.distribution(DIST)
    return Path(dist.locate_file(f"iniconfig/{name}")).read_text()


@pytest.fixture()
def stdlib(tmp_path) -> Path:
    root = tmp_path / "lib"
    (root / "email").mkdir(parents=True)
    (root / "copied.py").write_text(source("__init__.py"))                        # an exact copy
    lines = source("_parse.py").splitlines(keepends=True)
    (root / "email" / "vendored.py").write_text("".join(lines[: len(lines) * 3 // 4]) + "x = 1\n")  # most of it
    (root / "own.py").write_text("def unrelated_function_name(argument_one, argument_two):\n    return None\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skipped.py").write_text("ignored = True\n")
    return root


def test_copies_and_near_copies_are_dropped(stdlib):
    files, manifest = corpus.select(stdlib, [(DIST, md.version(DIST))])
    names = [a for a, _ in files]
    assert names[:3] == ["stdlib/copied.py", "stdlib/email/vendored.py", "stdlib/own.py"]
    extra = set(names[3:])
    assert "extra/iniconfig/iniconfig/__init__.py" not in extra and "extra/iniconfig/iniconfig/_parse.py" not in extra
    assert "extra/iniconfig/iniconfig/exceptions.py" in extra
    d = manifest["distributions"][0]
    assert (d["dropped_copies"], d["dropped_stdlib_near_copies"], d["files"]) == (1, 1, len(extra))
    assert manifest["stdlib_files"] == 3 and manifest["extra_files"] == len(extra)


def test_pins_are_checked(stdlib):
    """Every drifted or missing pin is named at once, with the install line that brings the pinned versions back;
    --any-version builds from what is installed and the manifest says so."""
    pins = [(DIST, "0.0.1"), ("no-such-distribution-tandem", "1.0")]
    with pytest.raises(SystemExit) as e:
        corpus.select(stdlib, pins)
    msg = str(e.value)
    assert f"{DIST} {md.version(DIST)} is installed, the corpus pins 0.0.1" in msg
    assert "no-such-distribution-tandem is not installed, the corpus pins 1.0" in msg
    assert f"pip install --no-deps --target DIR {DIST}==0.0.1 no-such-distribution-tandem==1.0" in msg
    report = corpus.select(stdlib, pins, strict=False)[1]["distributions"]
    assert [(d["pinned"], d["version"]) for d in report] == [("0.0.1", md.version(DIST)), ("1.0", "missing")]


def test_archive_is_deterministic(stdlib, tmp_path):
    files, manifest = corpus.select(stdlib, [(DIST, md.version(DIST))])
    corpus.pack(tmp_path / "a.tar.xz", files, manifest)
    corpus.pack(tmp_path / "b.tar.xz", files, manifest)
    assert (tmp_path / "a.tar.xz").read_bytes() == (tmp_path / "b.tar.xz").read_bytes()
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        assert tar.getnames() == ["manifest.json"] + [a for a, _ in files]
        assert json.load(io.BytesIO(tar.extractfile("manifest.json").read()))["extra_files"] == len(files) - 3


def test_pinned_list_is_installed_here():
    """The pins name distributions this environment has (the list a rebuild reads); none twice."""
    names = [n for n, _ in corpus.PACKAGES]
    assert len(names) == len(set(names))
    assert all(md.distribution(n) for n in names)
