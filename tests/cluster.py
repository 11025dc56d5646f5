"""A real local Tandem cluster for tests: target, draft and gateway(s) as separate OS processes.

    with Cluster(model_dir, k=4, gateways=[{"hidden_transport": "gloo"}, {"hidden_transport": "inline"}]) as c:
        c.gateways[0].stub.Generate(...)      # tandem.v1.GenerateService
        c.target.Prefill(...)                 # raw TargetService calls
        c.draft.Propose(...)                  # raw DraftService calls

Parallel layouts and several services (all in one cluster, started together):

    Cluster(model, targets=[{"args": ["--tp", "2", "--sequence-parallel"]}],
            drafts=[{"args": ["--tp", "2"], "env": {"TANDEM_FAULT": "skip_sp_gather"}}])
    Cluster(model, hidden_transport="inline", targets=[{"name": "t1"}, {"name": "t2", "args": ["--tp", "2"]}],
            drafts=[{"name": "d1"}], gateways=[{"target": 0, "draft": 0}, {"target": 1, "draft": 0}])

A service of `--tp N` is N rank processes: the cluster starts rank 0 (it starts the others, which
log to the same file); every service gets its own free `--dist-addr`. Several targets or drafts
need `hidden_transport="inline"` (one bridge joins exactly one target and one draft).

TLS: `Cluster(model, tls=TlsFiles(cert, key, ca))` gives every process `--tls-cert/--tls-key/--tls-ca`
(mutual TLS between the services) and makes every channel of this helper a TLS channel with them.

Faults: `c.kill("draft")` SIGKILLs a process (with its rank workers) as a crash would, and
`c.restart("draft")` starts it again with the same command and ports, appending to its log.

Every process gets free ports, `--threads 1` where the flag exists, and a log file in a temporary
directory. Start-up waits for gRPC health SERVING on each (and, when the services run a bridge,
for the bridge to carry a frame end to end); a process that exits early or a timeout raises with
the tails of all logs. Teardown sends SIGTERM, then kills what is still alive after a grace period.
This is a helper, not a test file.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra import tls as tls_mod
from infra.grpc_server import channel_options
from infra.ports import free_ports  # noqa: F401 (the tests take it from here)
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2_grpc, rows_pb2, target_pb2, target_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Proc:
    name: str
    cmd: list[str]
    addr: str
    log: Path
    popen: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)     # added to the environment (rank workers inherit it)

    def tail(self, n_chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        rc = None if self.popen is None else self.popen.poll()
        state = "running" if rc is None else f"exited with code {rc}"
        return f"----- {self.name} ({state}) {self.log} -----\n{text[-n_chars:]}"


@dataclass
class Gateway:
    name: str
    addr: str
    hidden_transport: str
    k: int
    channel: grpc.Channel = field(repr=False, default=None)
    stub: generate_pb2_grpc.GenerateServiceStub = field(repr=False, default=None)
    target: int = 0                  # index into Cluster.targets / drafts it talks to
    draft: int = 0
    http_url: str = ""               # its REST API, e.g. http://127.0.0.1:PORT (every gateway gets a free port)


class ClusterError(RuntimeError):
    pass


class Cluster:
    def __init__(self, model: str | Path, k: int = 4, gateways: list[dict] | None = None,
                 hidden_transport: str = "gloo", log_dir: str | Path | None = None,
                 startup_timeout_s: float = 240.0, extra_service_args: list[str] | None = None,
                 targets: list[dict] | None = None, drafts: list[dict] | None = None,
                 tls: tls_mod.TlsFiles | None = None):
        """gateways: one dict per gateway process: hidden_transport (default: the services'), k
        (default: `k`), max_batch, target and draft (indices into `targets` / `drafts`, default 0),
        args (extra gateway flags), env (extra environment variables).
        `hidden_transport` is the targets' and drafts' own setting.
        targets, drafts: one dict per service (default: one each): name (default "target" /
        "draft", or "target{i}" / "draft{i}" when there are several), args (extra flags, e.g.
        ["--tp", "2", "--ep", "2", "--sequence-parallel"]), env (extra environment variables)."""
        self.model, self.k = str(model), k
        self.hidden_transport = hidden_transport
        self.gateway_specs = gateways or [{}]
        self.target_specs, self.draft_specs = targets or [{}], drafts or [{}]
        if hidden_transport != "inline" and (len(self.target_specs) > 1 or len(self.draft_specs) > 1):
            raise ValueError("several targets or drafts need hidden_transport='inline' (a bridge joins one pair)")
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="tandem-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.extra_service_args = extra_service_args or []
        self.tls = tls or tls_mod.PLAINTEXT
        self.tls_args = [x for flag, path in (("--tls-cert", self.tls.cert), ("--tls-key", self.tls.key),
                                              ("--tls-ca", self.tls.ca)) if path for x in (flag, path)]
        self.procs: list[Proc] = []
        self.gateways: list[Gateway] = []
        self._channels: list[grpc.Channel] = []
        self.targets: list[target_pb2_grpc.TargetServiceStub] = []
        self.drafts: list[draft_pb2_grpc.DraftServiceStub] = []
        self.target: target_pb2_grpc.TargetServiceStub | None = None     # targets[0], drafts[0]
        self.draft: draft_pb2_grpc.DraftServiceStub | None = None

    # --- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        try:
            self._start()
        except BaseException as e:
            logs = self.logs()
            self.stop()
            raise ClusterError(f"cluster did not start: {e}\n{logs}") from e
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            print(self.logs(), file=sys.stderr)
        self.stop()
        return False

    def _start(self) -> None:
        n_t, n_d, n_gw = len(self.target_specs), len(self.draft_specs), len(self.gateway_specs)
        ports = free_ports(1 + 2 * (n_t + n_d) + 2 * n_gw)
        bridge_port = ports.pop()
        py = [sys.executable, "-m", "tandem"]
        common = ["--model", self.model, "--threads", "1", "--hidden-transport", self.hidden_transport,
                  "--bridge-addr", f"127.0.0.1:{bridge_port}", "--num-blocks", "1024"] + self.tls_args \
            + self.extra_service_args

        def service(role: str, i: int, n: int, spec: dict) -> Proc:
            name = spec.get("name", role if n == 1 else f"{role}{i}")
            port, dist_port = ports.pop(), ports.pop()
            cmd = py + [role, "--grpc-port", str(port), "--dist-addr", f"127.0.0.1:{dist_port}"] + common
            return Proc(name, cmd + list(spec.get("args", [])), f"127.0.0.1:{port}", self.log_dir / f"{name}.log",
                        env=dict(spec.get("env", {})))
        targets = [service("target", i, n_t, spec) for i, spec in enumerate(self.target_specs)]
        drafts = [service("draft", i, n_d, spec) for i, spec in enumerate(self.draft_specs)]
        gws = []
        for i, spec in enumerate(self.gateway_specs):
            transport = spec.get("hidden_transport", self.hidden_transport)
            k, t, d = spec.get("k", self.k), spec.get("target", 0), spec.get("draft", 0)
            name = spec.get("name", f"gateway{i}-{transport}")
            port, http_port = ports.pop(), ports.pop()
            cmd = py + ["gateway", "--model", self.model, "-k", str(k), "--grpc-port", str(port),
                        "--http-port", str(http_port),
                        "--target-addr", targets[t].addr, "--draft-addr", drafts[d].addr,
                        "--hidden-transport", transport, "--max-batch", str(spec.get("max_batch", 64)),
                        "--speculation", "fixed"] + self.tls_args       # every round drafts K (args may override)
            proc = Proc(name, cmd + list(spec.get("args", [])), f"127.0.0.1:{port}", self.log_dir / f"{name}.log",
                        env=dict(spec.get("env", {})))
            gws.append((proc, transport, k, t, d, f"http://127.0.0.1:{http_port}"))
        # targets and drafts load in parallel; the gateways wait for both themselves
        services = targets + drafts + [g[0] for g in gws]
        for p in services:
            self._spawn(p)
        deadline = time.monotonic() + self.startup_timeout_s
        for p in services:
            self.wait_serving(p, deadline)
        self.targets = [target_pb2_grpc.TargetServiceStub(self.channel(p.addr)) for p in targets]
        self.drafts = [draft_pb2_grpc.DraftServiceStub(self.channel(p.addr)) for p in drafts]
        self.target, self.draft = self.targets[0], self.drafts[0]
        for proc, transport, k, t, d, http_url in gws:
            ch = self.channel(proc.addr)
            self.gateways.append(Gateway(proc.name, proc.addr, transport, k, ch,
                                         generate_pb2_grpc.GenerateServiceStub(ch), t, d, http_url))
        if self.hidden_transport != "inline":
            self.wait_bridge(deadline)

    def _spawn(self, p: Proc, again: bool = False) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **p.env}
        with open(p.log, "ab" if again else "wb") as f:
            p.popen = subprocess.Popen(p.cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        if not again:
            self.procs.append(p)

    # --- faults (tests/test_faults.py) -------------------------------------------------------------
    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def kill(self, name: str, whole_session: bool = True) -> None:
        """SIGKILL a process as a crash would: with its rank workers (its session), or only itself."""
        p = self.proc(name)
        if whole_session:
            self._kill_session(p)
        else:
            p.popen.kill()
        p.popen.wait(timeout=30)

    def restart(self, name: str, wait: bool = True) -> None:
        """Start a killed process again: the same command, ports and environment; its log is appended to."""
        p = self.proc(name)
        assert p.popen.poll() is not None, f"{name} is still running"
        self._spawn(p, again=True)
        if wait:
            self.wait_serving(p, time.monotonic() + self.startup_timeout_s)

    def channel(self, addr: str) -> grpc.Channel:
        ch = tls_mod.channel(addr, self.tls, options=channel_options())
        self._channels.append(ch)
        return ch

    def wait_serving(self, p: Proc, deadline: float) -> None:
        """Poll gRPC health until SERVING; fail at once if the process exits."""
        ch = tls_mod.channel(p.addr, self.tls)
        try:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if p.popen.poll() is not None:
                    raise ClusterError(f"{p.name} exited with code {p.popen.returncode} while starting")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClusterError(f"{p.name} at {p.addr} was not SERVING in {self.startup_timeout_s:.0f}s")
                try:
                    # wait_for_ready blocks until the port accepts (or the deadline), not a fixed sleep
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(2.0, left), wait_for_ready=True)
                    if resp.status == SERVING:
                        return
                except grpc.RpcError:
                    pass
        finally:
            ch.close()

    def wait_bridge(self, deadline: float) -> None:
        """The services' bridge connects in the background after health says SERVING. Poll with a
        one-token Prefill asking for BRIDGE rows until the target sends them on the bridge, then
        make the draft take that frame (a Propose) so both ends are proven; release the probes."""
        n = 0
        while True:
            n += 1
            rid = f"bridge-probe-{n}"
            try:
                resp = self.target.Prefill(target_pb2.PrefillRequest(
                    items=[target_pb2.PrefillItem(request_id=rid, prompt_token_ids=[5])],
                    return_hidden_rows=True, transport=rows_pb2.TRANSPORT_BRIDGE), timeout=30)
                if resp.hidden_rows.transport == rows_pb2.TRANSPORT_BRIDGE:
                    self.draft.Propose(draft_pb2.ProposeRequest(
                        items=[draft_pb2.ProposeItem(request_id=rid, new_token_ids=[5, resp.first_token_ids[0]],
                                                     num_draft_tokens=1)],
                        hidden_rows=[resp.hidden_rows]), timeout=30)
                    return
            finally:
                self.release([rid])
            if time.monotonic() > deadline:
                raise ClusterError("the target never sent rows on the bridge (its channel is not ready)")
            time.sleep(0.2)   # polling a background connect; nothing to await on the wire

    def release(self, request_ids: list[str]) -> None:
        req = common_pb2.ReleaseRequest(request_ids=request_ids)
        self.target.Release(req, timeout=10)
        self.draft.Release(req, timeout=10)

    def wait_drained(self, timeout_s: float = 30.0) -> None:
        """Until every target and draft holds no request and every KV block is free. The gateway
        releases asynchronously after it answers, so poll GetInfo (no event to await) up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        stubs = self.targets + self.drafts
        while True:
            infos = [s.GetInfo(common_pb2.InfoRequest(), timeout=10) for s in stubs]
            if all(i.running_requests == 0 and i.kv_blocks_free == i.kv_blocks_total for i in infos):
                return
            if time.monotonic() > deadline:
                names = [f"target{i}" for i in range(len(self.targets))] + [f"draft{i}" for i in range(len(self.drafts))]
                left = ", ".join(f"{n} {i}" for n, i in zip(names, infos)
                                 if i.running_requests or i.kv_blocks_free != i.kv_blocks_total)
                raise AssertionError(f"state left in the services {timeout_s:.0f}s after all requests ended: {left}")
            time.sleep(0.2)

    def health(self, addr: str, service: str = "") -> int:
        ch = tls_mod.channel(addr, self.tls)
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=5).status
        finally:
            ch.close()

    def addrs(self) -> dict[str, str]:
        return {p.name: p.addr for p in self.procs}

    def dead(self) -> list[str]:
        """Processes that have exited (none should while the cluster is up)."""
        return [f"{p.name} (code {p.popen.returncode})" for p in self.procs if p.popen.poll() is not None]

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def stop(self, grace_s: float = 10.0) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        for p in reversed(self.procs):      # gateways first: they hold the services' clients
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=10)
        for p in self.procs:                # rank workers left behind (their rank 0 was killed)
            self._kill_session(p)

    @staticmethod
    def _kill_session(p: Proc) -> None:
        """Each process was started in its own session (pgid = its pid); its rank workers share it."""
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def running(pid: int) -> bool:
    """Neither gone nor a zombie (a zombie has ended; its parent, or init for an orphan, reaps it any moment)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_serve(proc: subprocess.Popen, channels=()) -> None:
    """Stop a `tandem serve` started in its own session: SIGTERM (it stops its children), then SIGKILL to
    whatever is left of its process tree."""
    for ch in channels:
        ch.close()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve_module(c: Cluster, request):
    """Body of a module-scoped pytest fixture: yield the cluster; afterwards, if a test of the
    session failed meanwhile or a process died, print every process's log tail to the terminal."""
    failed_before = request.session.testsfailed
    yield c
    dead = c.dead()
    if request.session.testsfailed > failed_before or dead:
        capman = request.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled():
            print(f"\n===== cluster logs ({c.log_dir}) =====\n{c.logs()}")
    assert not dead, f"cluster processes exited during the tests: {dead}"


def make_checkpoint(path: str | Path, seed: int, draft_follows_bigram: bool = True,
                    overrides: dict | None = None) -> Path:
    """make_tiny(path, seed, overrides) (models.presets.TINY_V32: the same with DSA); then (by default)
    re-aim the draft's MTP layer so its drafts get
    accepted part of the time. The target stays exactly make_tiny's.

    Random MTP weights give ~0 acceptance, which leaves every accept/rollback path of a round
    untested. make_tiny's target agrees with its own "bigram" argmax(lm_head(norm(embed(t)))) at
    ~40 % of greedy steps, so an MTP layer whose eh_proj passes the token embedding through
    (identity on the embedding half, the hidden half scaled to 0.3) and whose block writes are
    halved proposes that bigram: measured per-position acceptance ~0.47, 0.19, 0.09, 0.04 at K=4,
    i.e. rounds accept 0..K drafts. Only draft tensors change, so lossless checks are unaffected.
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from models.tiny import make_tiny
    out = make_tiny(path, seed=seed, overrides=overrides)
    if not draft_follows_bigram:
        return out
    mtp = f"model.layers.{json.loads((out / 'config.json').read_text())['num_hidden_layers']}."
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, w in list(tensors.items()):
            if not name.startswith(mtp):
                continue
            if name == mtp + "eh_proj.weight":              # input: cat[enorm(embed), hnorm(hidden)]
                d = w.shape[0]
                tensors[name] = torch.cat([torch.eye(d, dtype=w.dtype), 0.3 * w[:, d:]], 1).contiguous()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = (0.5 * w).contiguous()
        save_file(tensors, str(f))
    return out

