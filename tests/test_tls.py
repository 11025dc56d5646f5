"""Transport security: TLS and mutual TLS between every gRPC server and client, the gateway's API key
on gRPC, and loopback-only listeners.

Throwaway certificates are made at test time (the `cryptography` package): a CA, one certificate for
127.0.0.1 / localhost that every process uses as server and client certificate, and a rogue CA's
client certificate. The TLS cluster must serve (greedy output exact, REST over HTTPS), refuse
plaintext clients and clients without (or with a foreign) certificate, and answer UNAUTHENTICATED
on GenerateService without `authorization: Bearer KEY`.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import SERVING, Cluster, make_checkpoint, serve_module
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate
from services.rendezvous import tcp_store
from infra import tls as tls_mod
from tandem.v1 import common_pb2, generate_pb2 as gen, generate_pb2_grpc, target_pb2_grpc

KEY = "tls-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TIMEOUT = 60


# --- throwaway certificates ----------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = (b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
    return b.sign(issuer_key, hashes.SHA256())


def _write(d: Path, name: str, cert, key) -> tuple[str, str]:
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


def make_pki(d: Path) -> dict[str, tls_mod.TlsFiles]:
    """-> 'node' (CA-signed, with the CA: what every process gets), 'ca_only' (verifies servers, presents
    nothing), 'rogue' (a certificate of another CA)."""
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "node", "rogue_ca", "rogue")}
    ca_pem, _ = _write(d, "ca", _cert("tandem test CA", keys["ca"], "tandem test CA", keys["ca"], True), keys["ca"])
    node = _write(d, "node", _cert("tandem node", keys["node"], "tandem test CA", keys["ca"], False), keys["node"])
    rogue = _write(d, "rogue", _cert("rogue", keys["rogue"], "rogue CA", keys["rogue_ca"], False), keys["rogue"])
    return {"node": tls_mod.TlsFiles(*node, ca_pem), "ca_only": tls_mod.TlsFiles(ca=ca_pem),
            "rogue": tls_mod.TlsFiles(*rogue, ca_pem)}


# --- the cluster -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tls-ckpt") / "tiny", seed=29)


@pytest.fixture(scope="module")
def cluster(ckpt, pki, tmp_path_factory, request):
    with Cluster(ckpt, k=2, tls=pki["node"], log_dir=tmp_path_factory.mktemp("tls-logs"),
                 gateways=[{"args": ["--api-key", KEY, "--stats-interval", "0"]}]) as c:
        yield from serve_module(c, request)


def addr_of(c: Cluster, name: str) -> str:
    return next(p.addr for p in c.procs if p.name.startswith(name))


def health(addr: str, tls: tls_mod.TlsFiles) -> int:
    ch = tls_mod.channel(addr, tls)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    finally:
        ch.close()


pytestmark = pytest.mark.slow


def test_tls_cluster_serves_exact_output(cluster, ckpt):
    prompt = [5, 77, 301, 12]
    resp = cluster.gateways[0].stub.Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt), max_tokens=10, ignore_eos=True), timeout=TIMEOUT, metadata=AUTH)
    assert list(resp.token_ids) == greedy_generate(load_model(TargetModel, ckpt), prompt, 10)
    assert resp.spec_stats.num_drafts > 0, "the draft took part (its rows came over the bridge, its RPCs over mTLS)"
    assert all("TLS" in (cluster.log_dir / f"{p.name}.log").read_text() for p in cluster.procs)


def test_generate_needs_the_api_key(cluster, pki):
    stub = cluster.gateways[0].stub
    req = gen.GenerateRequest(text="def f():", max_tokens=2)
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req, timeout=TIMEOUT, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.GenerateStream(req, timeout=TIMEOUT, metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(list(stub.GenerateStream(req, timeout=TIMEOUT, metadata=AUTH))) >= 1
    assert health(cluster.gateways[0].addr, pki["node"]) == SERVING, "health stays open (orchestrators probe it)"


@pytest.mark.parametrize("client", ["plaintext", "ca_only", "rogue"])
def test_services_refuse_clients_without_a_trusted_certificate(cluster, pki, client):
    """Target and draft demand mutual TLS: plaintext fails the handshake, a TLS client without a
    certificate or with one of another CA is refused; the services keep serving."""
    tls = tls_mod.PLAINTEXT if client == "plaintext" else pki[client]
    for name in ("target", "draft"):
        ch = tls_mod.channel(addr_of(cluster, name), tls)
        try:
            with pytest.raises(grpc.RpcError) as e:
                target_pb2_grpc.TargetServiceStub(ch).GetInfo(common_pb2.InfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        finally:
            ch.close()
        assert health(addr_of(cluster, name), pki["node"]) == SERVING


def test_healthcheck_speaks_tls(cluster, pki):
    """The containers' probe (python -m tandem.healthcheck) with the TLS flags."""
    import subprocess
    import sys
    node = pki["node"]
    probe = [sys.executable, "-m", "tandem.healthcheck", addr_of(cluster, "target")]
    tls = ["--tls-cert", node.cert, "--tls-key", node.key, "--tls-ca", node.ca]
    assert subprocess.run(probe + tls, timeout=60).returncode == 0
    assert subprocess.run(probe, timeout=60).returncode == 1
    https = cluster.gateways[0].http_url.replace("http://", "https://") + "/health"
    assert subprocess.run([sys.executable, "-m", "tandem.healthcheck", https, "--tls-ca", node.ca],
                          timeout=60).returncode == 0


def test_gateway_public_side(cluster, pki):
    """The gateway's own listeners: TLS without client certificates (the API key authenticates), so a
    CA-only client works and a plaintext one does not; REST is HTTPS."""
    gw = cluster.gateways[0]
    ch = tls_mod.channel(gw.addr, pki["ca_only"])
    try:
        resp = generate_pb2_grpc.GenerateServiceStub(ch).Generate(
            gen.GenerateRequest(text="x = ", max_tokens=2), timeout=TIMEOUT, metadata=AUTH)
        assert resp.usage.completion_tokens >= 1
    finally:
        ch.close()
    with pytest.raises(grpc.RpcError) as e:
        health(gw.addr, tls_mod.PLAINTEXT)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    url = gw.http_url.replace("http://", "https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=pki["node"].ca), timeout=TIMEOUT) as http:
        assert http.get(url + "/health").status_code == 200
        assert http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 401
        r = http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(gw.http_url + "/health", timeout=10)


# --- loopback only -----------------------------------------------------------------------------------
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of pids holds."""
    owner = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[int(link[8:-1])] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in owner:
                host, port = f[1].split(":")
                out.append((_addr(host), int(port, 16), owner[int(f[9])]))
    return out


def session_pids(leaders: list[int]) -> set[int]:
    """The cluster's processes and their children (each process leads its own session)."""
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) in leaders:          # field 5: the process group
                pids.add(int(d))
    return pids


def test_every_listener_is_loopback(cluster):
    """gRPC servers, the gateway's HTTP port, the bridge's TCPStore (it bound every interface before
    tcp_store) and gloo's own sockets: nothing listens beyond loopback by default."""
    socks = listening(session_pids([p.popen.pid for p in cluster.procs]))
    assert len(socks) >= 5, socks
    assert all(host in LOOPBACK for host, _, _ in socks), [s for s in socks if s[0] not in LOOPBACK]


def test_rank_group_store_listens_on_its_host_only():
    """The TP rank group's rendezvous store (services/ranks.py) is made by the same tcp_store."""
    from datetime import timedelta
    store = tcp_store("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    store.set("k", "v")
    mine = [s for s in listening({os.getpid()}) if s[1] == store.port]
    assert mine and all(host in LOOPBACK for host, _, _ in mine), mine


def test_tls_flags_are_checked(tmp_path):
    from services.config import parse
    with pytest.raises(SystemExit, match="--tls-ca needs --tls-cert"):
        parse("target", ["--tls-ca", str(tmp_path)], "")
    with pytest.raises(SystemExit, match="go together"):
        parse("draft", ["--tls-cert", str(tmp_path / "x.pem")], "")
    with pytest.raises(SystemExit, match="no such file"):
        parse("target", ["--tls-cert", str(tmp_path / "x.pem"), "--tls-key", str(tmp_path / "x.key")], "")
