"""docker-compose.yml (and its GPU override) pass a real compose validator: Debian's `docker-compose`
(`config -q`; .ci/run installs it). Without it the test skips, except in CI, where it fails."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from cluster import REPO

COMPOSE = shutil.which("docker-compose")
FILES = {"cpu": ["docker-compose.yml"], "gpu": ["docker-compose.yml", "docker-compose.gpu.yml"]}


@pytest.fixture(scope="module")
def compose():
    if COMPOSE is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed (.ci/run installs Debian's docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    return COMPOSE


def config(compose, files: list[str], *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [compose, "--project-directory", str(REPO)]
    for f in files:
        args += ["-f", str(REPO / f)]
    return subprocess.run(args + ["config", *extra], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("variant", list(FILES))
def test_compose_file_is_valid(compose, variant):
    out = config(compose, FILES[variant], "-q")
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load(config(compose, FILES[variant], env={"TANDEM_MODEL": "/data/ckpt"}).stdout)
    services = spec["services"]
    assert set(services) == {"target", "draft", "gateway"}
    for name, s in services.items():
        assert s["healthcheck"]["test"][:3] == ["CMD", "python", "-m"], name
        assert any(str(v).startswith("/data/ckpt:/model") for v in s["volumes"]), name
        assert "--bridge-addr" not in s["command"] or "target:29650" in s["command"], name
    published = {str(p["target"] if isinstance(p, dict) else p.split(":")[-1]) for p in services["gateway"]["ports"]}
    assert {"8000", "50051"} <= published
    assert services["gateway"]["depends_on"]["target"]["condition"] == "service_healthy"
    if variant == "gpu":
        for name in ("target", "draft"):
            devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"] and "cuda" in services[name]["command"]


def test_the_validator_rejects_a_broken_file(compose, tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text((REPO / "docker-compose.yml").read_text().replace("healthcheck:", "helthcheck:", 1))
    out = subprocess.run([compose, "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "helthcheck" in out.stderr
