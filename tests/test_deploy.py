"""deploy/k8s/tandem-two-nodes.yaml: valid Kubernetes (kubernetes-validate, strict, offline schemas) and a
launch Tandem itself accepts: the target's env:// settings agree with the StatefulSet, and every container's
command parses with the real command-line parsers (--device cpu in place of cuda: this machine has no GPU)."""
from __future__ import annotations

import subprocess
import sys

import yaml

from cluster import REPO

MANIFEST = REPO / "deploy" / "k8s" / "tandem-two-nodes.yaml"
MODEL = REPO / "checkpoints" / "tandem-code-mini"


def here(command: list[str]) -> list[str]:
    """A container's flags as this machine can check them: CPU for CUDA, the bundled model for /model."""
    return [{"cuda": "cpu", "/model": str(MODEL)}.get(a, a) for a in command[2:]]


def docs() -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_manifest_is_valid_kubernetes():
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--no-warn", str(MANIFEST)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_validator_rejects_a_broken_manifest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST.read_text().replace("serviceName:", "serviceNmae:", 1))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--no-warn", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "serviceNmae" in out.stdout + out.stderr


def test_target_ranks_rendezvous_as_the_statefulset_places_them(monkeypatch):
    from services.config import parse
    d = docs()
    sts, svc = d[("StatefulSet", "tandem-target")], d[("Service", "tandem-target-ranks")]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env["RANK"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert int(env["WORLD_SIZE"]) == sts["spec"]["replicas"]
    assert env["MASTER_ADDR"] == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}"
    for rank in range(sts["spec"]["replicas"]):                    # each pod's flags, as Tandem reads them
        for k, v in {**env, "RANK": str(rank)}.items():
            monkeypatch.setenv(k, v)
        cfg = parse("target", here(c["command"]), "")
        assert (cfg.rank, cfg.tp, cfg.local_ranks) == (rank, 2, 1)
        assert cfg.dist_addr == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        assert str(cfg.dist_addr.rsplit(":", 1)[1]) in {str(p["port"]) for p in svc["spec"]["ports"]}


def test_front_reaches_rank_zero_and_its_commands_parse(monkeypatch):
    from gateway.config import parse as parse_gateway
    from services.config import parse
    d = docs()
    front = {c["name"]: c for c in d[("Deployment", "tandem-front")]["spec"]["template"]["spec"]["containers"]}
    gw = parse_gateway(here(front["gateway"]["command"]))
    assert gw.target_addr == "tandem-target-0.tandem-target-ranks:50052" and gw.draft_addr == "127.0.0.1:50053"
    draft = parse("draft", here(front["draft"]["command"]), "")
    assert draft.bridge_addr == "tandem-target-0.tandem-target-ranks:29650"
