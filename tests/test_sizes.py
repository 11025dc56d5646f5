"""Readable in one sitting (issue 13): no source file over 300 lines and no function over 80, outside the
tests and the training script (tandem/train.py keeps its loop in one place)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("infra", "kernels", "models", "services", "gateway", "tandem")
EXEMPT = {"tandem/train.py"}
MAX_FILE, MAX_FUNC = 300, 80


def sources():
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if "_pb2" not in rel and rel not in EXEMPT:
                yield rel, f.read_text()


def test_files_and_functions_stay_small():
    long = []
    for rel, src in sources():
        if (n := src.count("\n")) > MAX_FILE:
            long.append(f"{rel}: {n} lines (at most {MAX_FILE})")
        for node in ast.walk(ast.parse(src, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNC:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNC})")
    assert not long, "\n".join(long)
