"""Who may import whom (README "Architecture"), checked on the source and on a running gateway.

Floors, bottom up: infra/ (gRPC set-up, TLS, tracing, errors, paths) and the generated contracts
(tandem/v1/); kernels/; models/; services/ (target, draft, their bridge); gateway/ beside services; the
roof, tandem/ (CLI, serve, benchmarks, training). A module imports only from floors below its own. The
rules hold per file, and for the gateway also transitively, function-level imports included: whatever
chain of imports the gateway process can run never reaches torch or model code.
"""
import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OWN = ("infra", "tandem", "kernels", "models", "services", "gateway")
ROOF = ["tandem.cli", "tandem.serve", "tandem.bench", "tandem.train", "tandem.supervise", "tandem.healthcheck"]
RULES = {   # package -> import prefixes it must never use (tandem.v1, the generated contracts, is a bottom floor)
    "infra": ["torch", "models", "kernels", "services", "gateway", "triton"] + ROOF,
    "gateway": ["torch", "models", "kernels", "services", "triton", "flashinfer"] + ROOF,
    "services": ["gateway"] + ROOF,
    "services/target": ["services.draft", "gateway"],
    "services/draft": ["services.target", "gateway"],
    "services/bridge": ["services.target", "services.draft", "gateway"],
    "models": ["services", "gateway", "grpc", "tandem"],
    "kernels": ["models", "services", "gateway", "tandem", "grpc", "infra"],
}
GATEWAY_NEVER = ("torch", "models", "kernels", "services", "triton", "flashinfer", "numpy.testing")


def imports(path: Path, top_level_only: bool = False):
    """(line, module) of every import in the file, function-level ones included (unless top_level_only);
    `from a import b` yields a.b too (b may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def module_file(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


@pytest.mark.parametrize("package", sorted(RULES))
def test_dependency_rules(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, package
    bad = sorted({f"{f.relative_to(REPO)}:{line} imports {name}" for f in files for line, name in imports(f)
                  if any(name == p or name.startswith(p + ".") for p in RULES[package])})
    assert not bad, "\n".join(bad)


def test_gateway_reaches_no_torch_transitively():
    """Follow every import from the gateway's modules (and the CLI that starts it) through Tandem's own
    modules: the chain must never reach torch, models, kernels or services."""
    todo = ["tandem.__main__", "tandem.cli", "gateway.server"] + [f"gateway.{p.stem}" for p in (REPO / "gateway").glob("*.py")]
    seen, via = set(), {}
    bad = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            continue
        # the CLI: only what it imports at start; its functions serve the other subcommands, and it reaches
        # gateway.server (followed from the start) through importlib by name
        for line, imported in imports(path, top_level_only=name in ("tandem.cli", "tandem.__main__")):
            if imported.split(".")[0] in GATEWAY_NEVER or imported.startswith(GATEWAY_NEVER):
                chain, at = [f"{path.relative_to(REPO)}:{line} imports {imported}"], name
                while at in via:
                    chain.append(f"  reached from {via[at]}")
                    at = via[at].split(":")[0].removesuffix(".py").replace("/", ".")
                bad.append("\n".join(chain))
            elif imported.split(".")[0] in OWN and imported not in seen:
                via.setdefault(imported, f"{path.relative_to(REPO)}:{line}")
                todo.append(imported)
    assert not bad, "\n\n".join(bad)


def test_gateway_process_loads_no_torch(api_cluster):
    """The running gateway (started as `tandem serve` starts it: `python -m tandem gateway ...`) has no
    libtorch and no torch package among its mapped files."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/PID/maps")
    gw = api_cluster.cluster.proc("gateway-open")
    maps = Path(f"/proc/{gw.popen.pid}/maps").read_text()
    assert "libpython" in maps or "python" in maps, "not the gateway's own process map"
    torch_files = sorted({line.split()[-1] for line in maps.splitlines() if "torch" in line.split()[-1]})
    assert not torch_files, f"the gateway process mapped torch: {torch_files[:5]}"
    cmdline = Path(f"/proc/{gw.popen.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:4] == [b"-m", b"tandem", b"gateway"], cmdline
