"""`tandem corpus`: the training corpus of the bundled model's second edition, packed as one .tar.xz.

Two parts, both plain .py files under 256 KiB, paths kept relative:
* `stdlib/`: every .py of the CPython 3.11 standard library as `tandem train` splits it (test directories kept,
  site-packages / __pycache__ skipped): its seeded 5 % by file is the held-out set of the model card;
* `extra/<distribution>/`: training-only code, the .py files that the pinned distributions of PACKAGES
  install (their RECORD lists, read through importlib.metadata from the running environment), in a fixed
  order. Removed: exact copies (a file whose bytes occur earlier in the order, the stdlib first) and
  near-copies either way (NEAR of the file's distinctive lines occur in one stdlib file: vendored or backported
  stdlib modules such as setuptools' distutils; or NEAR of a stdlib file's, when it has MIN_SHARED or more:
  the code a stdlib module was copied from, such as jaraco.text for importlib.metadata._text), so no
  held-out file reaches training in any form.
`manifest.json` in the archive lists the distributions, versions, files kept and dropped, and the rule.

    tandem corpus --out build/corpus/python-code.tar.xz     # CPython 3.11.7 and the venv of `make install-test`
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import io
import json
import os
import sys
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

MAX_BYTES, NEAR, MIN_LINE, MIN_SHARED = 256 << 10, 0.5, 24, 8
# (distribution, version as installed when the corpus was built): human-written library code and its tests;
# left out: packages whose .py files are mostly generated tables or API stubs (chardet, fontTools, pygments'
# lexers, openai, sympy's, pyarrow's), the Python versions' own stdlibs, this repository, and for the archive's
# 28 MB (it travels with the repository) pandas, nltk and mpmath, whose code is mostly literal test data
PACKAGES = [
    ("pip", "26.3"), ("setuptools", "84.2.1"), ("packaging", "26.4"), ("pytest", "9.2.0"), ("pluggy", "1.7.0"),
    ("iniconfig", "2.3.1"), ("hypothesis", "6.170.17"), ("attrs", "26.1.0"), ("click", "8.5.1"),
    ("typer", "0.29.2"), ("rich", "15.0.0"), ("Jinja2", "3.1.6"), ("markdown-it-py", "4.3.0"), ("mdurl", "0.1.2"),
    ("pyparsing", "3.3.3"), ("six", "1.17.0"), ("python-dateutil", "2.9.0.post0"), ("pytz", "2026.6"),
    ("PyYAML", "6.0.4"), ("tabulate", "0.10.0"), ("tqdm", "4.70.1"), ("filelock", "4.3.1"), ("dill", "0.4.1"),
    ("multiprocess", "0.70.19"), ("joblib", "1.6.0"), ("fsspec", "2026.9.0"), ("requests", "2.34.2"),
    ("urllib3", "2.8.0"), ("idna", "3.20"), ("httpx", "0.28.1"), ("anyio", "4.16.0"), ("aiohttp", "3.14.5"),
    ("starlette", "1.10.0"), ("fastapi", "0.165.0"), ("uvicorn", "0.54.0"), ("jsonschema", "4.26.0"),
    ("pydantic", "2.14.4"), ("grpcio", "1.85.3"), ("absl-py", "2.5.1"), ("cffi", "2.1.1"),
    ("cryptography", "50.0.2"), ("regex", "2026.11.19"), ("networkx", "3.6.1"),
    ("numpy", "2.4.6"), ("scipy", "1.17.1"), ("scikit-learn", "1.9.1"),
    ("matplotlib", "3.11.2"), ("Pillow", "13.0.0"), ("sacrebleu", "2.6.0"),
    ("huggingface_hub", "2.4.0"), ("datasets", "5.2.0"), ("evaluate", "0.4.6"), ("lm_eval", "0.4.13"),
    ("safetensors", "0.8.0"), ("tokenizers", "0.23.3"), ("triton", "3.9.0"), ("torch", "2.13.0+cpu"),
    ("transformers", "5.24.0"),
]
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: Path) -> list[str]:
    # the stdlib's .py files as `tandem train` reads them (sorted relative posix paths), below MAX_BYTES
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and p.stat().st_size < 1 << 20)


def distinctive_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= MIN_LINE}


def drifted(packages) -> list[tuple[str, str, str]]:
    """(distribution, installed version or "missing", pin) for every pin the running environment does not match."""
    out = []
    for name, version in packages:
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            installed = "missing"
        if installed != version:
            out.append((name, installed, version))
    return out


def check_pins(packages, strict: bool) -> None:
    """Every drifted pin at once, with the way back to the pinned corpus: the pinned wheels in a folder of their
    own, first on the path (importlib.metadata reads the first it finds). A corpus from other versions differs."""
    off = drifted(packages)
    if not off:
        return
    msg = "tandem corpus: " + ", ".join(f"{n} {'is not installed' if i == 'missing' else i + ' is installed'}, the "
                                        f"corpus pins {v}" for n, i, v in off)
    if strict:
        pins = " ".join(f"{n}=={v}" for n, _, v in off)
        raise SystemExit(f"{msg}\n  the pinned corpus: pip install --no-deps --target DIR {pins}, then PYTHONPATH=DIR "
                         "tandem corpus\n  (or --any-version to build from what is installed; the manifest records it)")
    print("warning: " + msg, file=sys.stderr)


def distribution_files(name: str) -> list[tuple[str, Path]]:
    """(archive path, file) of the .py files a distribution installed, sorted."""
    dist = md.distribution(name)
    out = []
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if f.suffix == ".py" and not SKIP_DIRS & set(f.parts[:-1]) and ".." not in f.parts and p.is_file() \
                and p.stat().st_size < MAX_BYTES:
            out.append((f"extra/{name}/{f.as_posix()}", p))
    return sorted(out)


def select(stdlib: Path, packages=PACKAGES, strict: bool = True) -> tuple[list[tuple[str, bytes]], dict]:
    """[(distribution, pinned version)] -> [(archive path, bytes)] in archive order, and the manifest."""
    kept, seen, report = [], set(), []
    line_files, sizes = defaultdict(set), []                   # distinctive line -> stdlib files holding it
    for i, rel in enumerate(stdlib_files(stdlib)):
        data = (stdlib / rel).read_bytes()
        kept.append((f"stdlib/{rel}", data)), seen.add(hashlib.sha256(data).digest())
        sizes.append(len(lines := distinctive_lines(data.decode(errors="ignore"))))
        for s in lines:
            line_files[s].add(i)
    n_stdlib = len(kept)
    check_pins(packages, strict)
    missing = {n for n, i, _ in drifted(packages) if i == "missing"}
    for name, version in packages:
        stats = Counter()
        for arc, path in [] if name in missing else distribution_files(name):
            data = path.read_bytes()
            digest, lines = hashlib.sha256(data).digest(), distinctive_lines(data.decode(errors="ignore"))
            hits = Counter(i for s in lines for i in line_files.get(s, ()))
            if digest in seen:
                stats["dropped_copies"] += 1
            elif any(n >= NEAR * len(lines) or (n >= NEAR * sizes[i] and sizes[i] >= MIN_SHARED)
                     for i, n in hits.items()):
                stats["dropped_stdlib_near_copies"] += 1
            else:
                seen.add(digest), kept.append((arc, data))
                stats["files"] += 1
                stats["bytes"] += len(data)
        report.append(dict(distribution=name, version="missing" if name in missing else md.version(name),
                           pinned=version, **stats))
    manifest = dict(python=sys.version.split()[0], stdlib_root=str(stdlib),
                    stdlib_files=n_stdlib, stdlib_bytes=sum(len(d) for _, d in kept[:n_stdlib]),
                    extra_files=len(kept) - n_stdlib, extra_bytes=sum(len(d) for _, d in kept[n_stdlib:]),
                    rule=(f".py files < {MAX_BYTES} bytes; exact copies of an earlier file dropped (stdlib first); a "
                          f"package file is dropped as a stdlib near-copy when >= {NEAR:.0%} of its distinct stripped "
                          f"lines of >= {MIN_LINE} characters occur in one stdlib file, or >= {NEAR:.0%} of a stdlib "
                          f"file's (when it has >= {MIN_SHARED}) occur in it"),
                    distributions=report)
    return kept, manifest


def pack(out: Path, files: list[tuple[str, bytes]], manifest: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for arc, data in [("manifest.json", json.dumps(manifest, indent=1).encode())] + files:
            info = tarfile.TarInfo(arc)
            info.size, info.mtime, info.mode = len(data), 0, 0o644     # no dates or owners: the same bytes each build
            tar.addfile(info, io.BytesIO(data))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/corpus/python-code.tar.xz")
    p.add_argument("--stdlib", default=str(Path(os.__file__).parent), help="CPython 3.11 stdlib root")
    p.add_argument("--any-version", action="store_true", help="warn instead of failing when a pin differs")
    p.add_argument("--list", action="store_true", help="print the manifest, write nothing")
    a = p.parse_args(argv)
    files, manifest = select(Path(a.stdlib), strict=not a.any_version)
    print(json.dumps({k: v for k, v in manifest.items() if k != "distributions"}, indent=1))
    for d in manifest["distributions"]:
        print(f"  {d['distribution']:<18} {d['version']:<14} files {d.get('files', 0):5d}  "
              f"bytes {d.get('bytes', 0):>11,}  copies {d.get('dropped_copies', 0):4d}  near-copies {d.get('dropped_stdlib_near_copies', 0):3d}")
    if not a.list:
        pack(Path(a.out), files, manifest)
        print(f"{a.out}: {len(files)} files, {Path(a.out).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
