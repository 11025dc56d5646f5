"""Who may import whom (DESIGN.md, "Dependency rules"), checked on the source: a violation names the
file, the line and the import."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RULES = {   # package -> import prefixes it must never use
    "gateway": ["torch", "models", "kernels", "services", "triton", "flashinfer"],
    "services/target": ["services.draft", "gateway"],
    "services/draft": ["services.target", "gateway"],
    "services/bridge": ["services.target", "services.draft", "gateway"],
    "models": ["services", "gateway", "grpc", "tandem"],
    "kernels": ["models", "services", "gateway", "tandem", "grpc"],
}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module


@pytest.mark.parametrize("package", sorted(RULES))
def test_dependency_rules(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, package
    bad = [f"{f.relative_to(REPO)}:{line} imports {name}" for f in files for line, name in imports(f)
           if any(name == p or name.startswith(p + ".") for p in RULES[package])]
    assert not bad, "\n".join(bad)
