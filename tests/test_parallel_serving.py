"""Tensor-, expert- and sequence-parallel serving through real clusters (CPU, gloo ranks).

Layouts: targets (tp, ep, sp) in {(1,1,off), (2,1,off), (2,1,on), (2,2,on)} x drafts of tp 1 and
tp 2 (a tp-2 draft runs SP when its target does, as `tandem serve --sequence-parallel` starts it;
at tp 1 SP has nothing to split). The 8 combinations share processes: one cluster of 4 targets, 3
drafts and 8 gateways (one per combination) on inline rows, started together. Every gateway gets
the same streamed requests: single requests sent alone (so a step's token count T is 1, 3 and 19
in prefill and decode; two of them seeded sampling), then a concurrent batch of mixed lengths.
Tokens, tokens per round (one stream message per commit: accepted + 1) and per-request spec_stats
must equal the (1,1,off) / draft-tp-1 combination's: SP must not cost a single accepted token.

Then the SP row contract end to end: a draft of tp 2 with SP and TANDEM_FAULT=skip_sp_gather (its
MTP block returns this rank's ceil(T_pad / tp) rows) must answer INVALID_ARGUMENT naming both
counts (the client gets INTERNAL / REST 500 `hidden_rows_contract`: the fault is the cluster's), within a deadline, with every process still SERVING; a cluster started again without the
switch serves the same request normally. A target whose checkpoint cannot take its layout (experts
not divisible by ep, heads not by tp) exits at start naming both numbers. Last, the real `tandem
serve --tp 2 --ep 2 --sequence-parallel --draft-tp 2` (gloo bridge) serves, and exits 0 on SIGTERM
leaving no process.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from cluster import REPO, Cluster, free_ports, make_checkpoint, serve_module
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate
from infra.grpc_server import channel_options
from tandem.v1 import common_pb2, draft_pb2, generate_pb2 as gen, generate_pb2_grpc, rows_pb2, target_pb2, \
    target_pb2_grpc

pytestmark = pytest.mark.slow

K = 4
SEED = 11
VOCAB = 512
RPC_TIMEOUT = 120
FAULT_DEADLINE_S = 30        # a contract error must come back well within this (never a hang)
SP = ["--sequence-parallel"]

TARGETS = {(1, 1, False): [], (2, 1, False): ["--tp", "2"], (2, 1, True): ["--tp", "2"] + SP,
           (2, 2, True): ["--tp", "2", "--ep", "2"] + SP}
DRAFTS = {"tp1": [], "tp2": ["--tp", "2"], "tp2-sp": ["--tp", "2"] + SP}
COMBOS = [(t, dtp) for t in TARGETS for dtp in (1, 2)]        # (target layout, draft tp)
REF = ((1, 1, False), 1)
CACHED = ((2, 1, True), 2)           # the TP2 + SP layout, also served with prefix caching off (the last gateway)


def draft_name(combo) -> str:
    """The DRAFTS process a combination uses: tp 2 runs SP when its target does."""
    (_, _, sp), dtp = combo
    return "tp1" if dtp == 1 else ("tp2-sp" if sp else "tp2")


def layout_id(layout) -> str:
    tp, ep, sp = layout
    return f"tp{tp}-ep{ep}-sp{'on' if sp else 'off'}"


def combo_id(combo) -> str:
    return f"target-{layout_id(combo[0])}--draft-tp{combo[1]}"


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 37 * i) % (VOCAB - 3) + 3 for i in range(n)]


# Sent alone, one after the other: (name, prompt, max_tokens, num_speculative_tokens or None = K).
# A prompt of n tokens is a target Prefill of T = n and the draft's first step of T = n; K = 0
# makes every Verify T = 1, K = 2 makes it T = 3. The sampled ones (seeded) check that rank 0
# decides every sample: no layout may change one.
SINGLES = [
    ("alone-T3", ids(3, 1), 12, None),
    ("alone-T19", ids(19, 2), 12, None),
    ("alone-T1", ids(1, 3), 12, None),
    ("alone-verify-T1", ids(5, 4), 6, 0),
    ("alone-verify-T3", ids(4, 5), 10, 2),
    ("alone-sampled-T3", ids(3, 6), 12, None),
    ("alone-sampled-T19", ids(19, 7), 12, None),
]
SAMPLED = {"alone-sampled-T3": (0.8, 0, 3), "alone-sampled-T19": (1.0, 50, 4)}   # temperature, top_k, seed
# Sent together: 24 prompts of lengths 1..40 (1, 3 and 19 among them), K 1..4 and max_tokens 6..20.
BATCH = [(f"batch{i}-len{n}", ids(n, 100 + i), 6 + (i * 5) % 15, (None, 3, 2, 1)[i % 4] if i % 3 else None)
         for i, n in enumerate([1, 3, 19, 40, 7, 2, 33, 12, 19, 3, 25, 1, 9, 16, 38, 5, 21, 3, 11, 28, 1, 14, 19, 30])]
CASES = SINGLES + BATCH


def request(prompt: list[int], max_tokens: int, k: int | None = None, name: str = "") -> gen.GenerateRequest:
    r = gen.GenerateRequest(max_tokens=max_tokens, ignore_eos=True)
    r.token_ids.ids.extend(prompt)
    if k is not None:
        r.num_speculative_tokens = k
    if name in SAMPLED:
        r.temperature, r.top_k, r.seed = SAMPLED[name]
    return r


@dataclass
class Served:
    """One streamed request: the gateway sends one message per commit (the Prefill's token, then
    each round's a + 1 tokens), so `rounds` is the per-round accepted count + 1."""
    tokens: list[int]
    rounds: list[int]                  # tokens per message
    stats: tuple                       # (num_drafts, num_draft_tokens, num_accepted_tokens, per position)
    finish: int


def collect(call) -> Served:
    msgs = list(call)
    s = msgs[-1].spec_stats
    return Served([t for m in msgs for t in m.token_ids], [len(m.token_ids) for m in msgs],
                  (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position)),
                  msgs[-1].finish_reason)


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=SEED)


@pytest.fixture(scope="module")
def ref_model(ckpt):
    torch.set_num_threads(1)
    return load_model(TargetModel, ckpt)


@pytest.fixture(scope="module")
def mesh(ckpt, tmp_path_factory, request):
    t_names, d_names = list(TARGETS), list(DRAFTS)
    targets = [{"name": f"target-{layout_id(t)}", "args": TARGETS[t]} for t in t_names]
    drafts = [{"name": f"draft-{d}", "args": DRAFTS[d]} for d in d_names]
    gateways = [{"name": "gateway-" + combo_id(c), "target": t_names.index(c[0]), "draft": d_names.index(draft_name(c))}
                for c in COMBOS]
    off = ["--no-prefix-cache"]
    targets.append({"name": "target-tp2-sp-nocache", "args": TARGETS[CACHED[0]] + off})
    drafts.append({"name": "draft-tp2-sp-nocache", "args": DRAFTS["tp2-sp"] + off})
    gateways.append({"name": "gateway-nocache", "target": len(targets) - 1, "draft": len(drafts) - 1})
    with Cluster(ckpt, k=K, hidden_transport="inline", targets=targets, drafts=drafts, gateways=gateways,
                 log_dir=tmp_path_factory.mktemp("mesh-logs")) as c:
        yield from serve_module(c, request)


@pytest.fixture(scope="module")
def served(mesh) -> dict:
    """combo -> {case name: Served}: each gateway streams SINGLES one by one, then all of BATCH at
    once (every stream started before any is read); the 8 gateways run side by side."""
    def run(stub):
        out = {name: collect(stub.GenerateStream(request(p, m, k, name), timeout=RPC_TIMEOUT))
               for name, p, m, k in SINGLES}
        calls = [(name, stub.GenerateStream(request(p, m, k), timeout=RPC_TIMEOUT)) for name, p, m, k in BATCH]
        out.update((name, collect(call)) for name, call in calls)
        return out
    with ThreadPoolExecutor(max_workers=len(mesh.gateways)) as pool:
        results = list(pool.map(run, [g.stub for g in mesh.gateways]))
    return {**dict(zip(COMBOS, results)), "nocache": results[len(COMBOS)]}


# --- layouts: identical tokens and acceptance --------------------------------------------------
def test_reference_combination_is_lossless_and_accepts_drafts(served, ref_model):
    assert len(CASES) >= 20
    assert {1, 3, 19} <= {len(p) for _, p, _, _ in CASES}
    out = served[REF]
    for name, prompt, max_tokens, _ in SINGLES + BATCH[:6]:
        if name not in SAMPLED:
            assert out[name].tokens == greedy_generate(ref_model, prompt, max_tokens), name
    for name in SAMPLED:            # sampled: not the greedy continuation, and it drafted
        prompt, max_tokens = next((p, m) for n, p, m, _ in SINGLES if n == name)
        assert out[name].tokens != greedy_generate(ref_model, prompt, max_tokens) and out[name].stats[0] > 0, name
    for name, _, max_tokens, k in CASES:
        r, k = out[name], K if k is None else k
        drafts, draft_tokens, accepted, per = r.stats
        assert len(r.tokens) == max_tokens and r.finish == gen.FINISH_REASON_LENGTH, name
        assert draft_tokens == k * drafts and sum(per) == accepted, f"{name}: {r.stats}"
        assert (len(r.rounds) == 1 + drafts) if k else (r.rounds == [1] * max_tokens), f"{name}: {r.rounds} {r.stats}"
        assert all(1 <= n <= k + 1 for n in r.rounds), f"{name}: {r.rounds}"
    accepted = sum(r.stats[2] for r in out.values())
    drafted = sum(r.stats[1] for r in out.values())
    assert 0.05 < accepted / drafted < 0.9, f"acceptance {accepted}/{drafted}: rounds do not exercise rollback"


@pytest.mark.parametrize("combo", [c for c in COMBOS if c != REF], ids=combo_id)
def test_layout_serves_identical_tokens_and_acceptance(served, combo):
    ref, got = served[REF], served[combo]
    for name, _, _, _ in CASES:
        assert got[name].tokens == ref[name].tokens, f"{name}: tokens differ from {combo_id(REF)}"
        assert got[name].rounds == ref[name].rounds, \
            f"{name}: tokens per round (accepted + 1) {got[name].rounds} != {ref[name].rounds}"
        assert got[name].stats == ref[name].stats, \
            f"{name}: spec_stats (drafts, draft tokens, accepted, per position) {got[name].stats} != {ref[name].stats}"
        assert got[name].finish == ref[name].finish, name


def test_prefix_caching_on_equals_off_with_tp2_sp(mesh, served):
    """TP2 + SP target and TP2 + SP draft: the same tokens, rounds and acceptance with the prefix cache on (it
    took hits: every prompt also reached that target through another gateway) as with it off."""
    on, off = served[CACHED], served["nocache"]
    for name, _, _, _ in CASES:
        assert (on[name].tokens, on[name].rounds, on[name].stats) == (off[name].tokens, off[name].rounds,
                                                                     off[name].stats), name
    def info(name: str):
        stub = target_pb2_grpc.TargetServiceStub(mesh.channel(mesh.proc(name).addr))
        return stub.GetInfo(common_pb2.InfoRequest(), timeout=30)
    cached, nocache = info("target-" + layout_id(CACHED[0])), info("target-tp2-sp-nocache")
    assert cached.prefix_caching and cached.prefix_cache_hits > 0, cached
    assert not nocache.prefix_caching and nocache.prefix_cache_hits == 0


def test_mesh_drained_and_serving(mesh, served):
    mesh.wait_drained()
    for name, addr in mesh.addrs().items():
        assert mesh.health(addr) == health_pb2.HealthCheckResponse.SERVING, name


# --- the SP fault switch: a loud contract error, never a hang or wrong tokens ------------------
FAULT_TARGET = TARGETS[(2, 2, True)]
FAULT_DRAFT = ["--tp", "2"] + SP


def fault_cluster(ckpt, log_dir, fault: bool) -> Cluster:
    env = {"TANDEM_FAULT": "skip_sp_gather"} if fault else {}
    return Cluster(ckpt, k=K, hidden_transport="gloo", log_dir=log_dir,
                   targets=[{"args": FAULT_TARGET + ["--no-prefix-cache"]}],   # each send: the whole prompt's step
                   drafts=[{"args": FAULT_DRAFT, "env": env}])


def expected_rows_message(T: int, tp: int = 2) -> str:
    actual = math.ceil(T / tp)                     # ceil(T_pad / tp): this rank's rows, not re-gathered
    return f"returned {actual} rows for {T} input tokens (expected {T})"


def test_skip_sp_gather_is_a_contract_error_then_restart_serves(ckpt, ref_model, tmp_path_factory):
    prompts = {19: ids(19, 2), 3: ids(3, 1)}
    want = {T: greedy_generate(ref_model, p, 12) for T, p in prompts.items()}
    with fault_cluster(ckpt, tmp_path_factory.mktemp("fault-logs"), fault=True) as c:
        stub = c.gateways[0].stub
        for T, prompt in prompts.items():
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(request(prompt, 12), timeout=RPC_TIMEOUT)
            took = time.monotonic() - t0
            # between the services the draft answered INVALID_ARGUMENT (below); the client is told INTERNAL: a
            # fault inside the cluster, never the client's
            assert e.value.code() == grpc.StatusCode.INTERNAL, f"T={T}: {e.value.code()} {e.value.details()}"
            assert took < FAULT_DEADLINE_S, f"T={T}: the contract error took {took:.1f}s"
            assert expected_rows_message(T) in e.value.details(), e.value.details()
            # streamed: what came before the error is the target's committed prefix, nothing else
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for msg in stub.GenerateStream(request(prompt, 12), timeout=RPC_TIMEOUT):
                    got += msg.token_ids
            assert e.value.code() == grpc.StatusCode.INTERNAL and expected_rows_message(T) in e.value.details()
            assert got == want[T][: len(got)], f"T={T}: tokens before the error are not the reference's"
        # REST: a 500 server_error whose code names the contract, the message both counts
        body = json.dumps({"prompt": prompts[19], "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(c.gateways[0].http_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=RPC_TIMEOUT)
        err = json.loads(http.value.read())["error"]
        assert http.value.code == 500 and err["type"] == "server_error" and err["code"] == "hidden_rows_contract", err
        assert expected_rows_message(19) in err["message"], err
        # the draft's own answer (raw Propose with the target's inline rows), not only the gateway's
        pre = c.target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id="raw-19", prompt_token_ids=prompts[19])], return_hidden_rows=True,
            transport=rows_pb2.TRANSPORT_INLINE), timeout=RPC_TIMEOUT)
        with pytest.raises(grpc.RpcError) as e:
            c.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id="raw-19", new_token_ids=prompts[19] + [pre.first_token_ids[0]], num_draft_tokens=K)],
                hidden_rows=[pre.hidden_rows]), timeout=FAULT_DEADLINE_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected_rows_message(19) in e.value.details(), e.value.details()
        c.release(["raw-19"])
        # the services stay up: SERVING, no state left behind, and plain decoding still right
        assert not c.dead()
        for name, addr in c.addrs().items():
            assert c.health(addr) == health_pb2.HealthCheckResponse.SERVING, name
        r = stub.Generate(request(prompts[19], 12, 0), timeout=RPC_TIMEOUT)
        assert list(r.token_ids) == want[19]
        c.wait_drained()
    with fault_cluster(ckpt, tmp_path_factory.mktemp("restart-logs"), fault=False) as c:
        for T, prompt in prompts.items():
            r = c.gateways[0].stub.Generate(request(prompt, 12), timeout=RPC_TIMEOUT)
            assert list(r.token_ids) == want[T], f"T={T}: restarted without the switch"
            assert r.spec_stats.num_drafts > 0 and r.spec_stats.num_draft_tokens == K * r.spec_stats.num_drafts


# --- layouts the checkpoint cannot take: a clear error at start, not a hang ---------------------
@pytest.mark.parametrize("field, value, flags, message", [
    ("n_routed_experts", 7, ["--tp", "2", "--ep", "2"], "n_routed_experts (7) is not divisible by ep (2)"),
    ("num_attention_heads", 3, ["--tp", "2"], "num_attention_heads (3) is not divisible by tp=2"),
], ids=["experts-by-ep", "heads-by-tp"])
def test_target_refuses_indivisible_layout(ckpt, tmp_path, field, value, flags, message):
    """Both ranks fail at build (before any weight is read) and the service exits non-zero."""
    import json
    raw = json.loads((ckpt / "config.json").read_text())
    raw[field] = value
    if field == "n_routed_experts":
        raw.update(n_group=1, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for f in ckpt.glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    port, dist_port = free_ports(2)
    cmd = [sys.executable, "-m", "tandem", "target", "--model", str(tmp_path), "--grpc-port", str(port),
           "--dist-addr", f"127.0.0.1:{dist_port}", "--hidden-transport", "inline", *flags]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)       # rank 0 and the rank it started share the session
        pytest.fail(f"tandem target --tp 2 with {field}={value} did not exit within 60s")
    assert p.returncode != 0 and message in out, f"rc {p.returncode}:\n{out[-3000:]}"


# --- the real CLI ------------------------------------------------------------------------------
def _serve_ports() -> list[int]:
    """gateway, target, draft, bridge, REST and dist ports, all distinct, drawn at once, with dist + 10 free and
    none of the others (`tandem serve` puts the draft's rendezvous at dist + 10): a port drawn in a later call, or
    dist + 10 left out of the draw, could be one another service binds a moment later (a CI flake, session 41)."""
    for _ in range(50):
        ports = free_ports(6)
        if ports[5] + 10 in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", ports[5] + 10))
            except OSError:
                continue
        return ports
    raise RuntimeError("no free port set for tandem serve")


def _serve_accepts(ckpt, flag: str) -> bool:
    from tandem.serve import parse
    try:
        parse(["--model", str(ckpt), flag, "1"])
    except SystemExit:
        return False
    return True


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tandem_serve_tp2_ep2_sp_draft_tp2(ckpt, ref_model, tmp_path):
    gw, tport, dport, bport, rest, dist = _serve_ports()
    cmd = [sys.executable, "-m", "tandem", "serve", "--model", str(ckpt), "--tp", "2", "--ep", "2",
           "--sequence-parallel", "--draft-tp", "2", "--grpc-port", str(gw), "--target-port", str(tport),
           "--draft-port", str(dport), "--bridge-port", str(bport), "--dist-port", str(dist),
           "--num-blocks", "256", "--startup-timeout", "180", "--speculation", "fixed"]
    if _serve_accepts(ckpt, "--http-port"):        # the gateway's REST port, where `tandem serve` has one
        cmd += ["--http-port", str(rest)]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while "grpc://" + f"127.0.0.1:{gw}" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"tandem serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"tandem serve did not print its endpoints:\n{log.read_text()[-6000:]}"
            time.sleep(0.3)
        text = log.read_text(errors="replace")
        assert "tandem: serving" in text
        for name, port in (("target", tport), ("draft", dport), ("gateway", gw)):
            assert re.search(rf"{name}\s+grpc://127\.0\.0\.1:{port}", text), f"{name} endpoint not printed:\n{text[-3000:]}"
        prompt = ids(19, 2)
        with grpc.insecure_channel(f"127.0.0.1:{gw}", options=channel_options()) as ch:
            r = generate_pb2_grpc.GenerateServiceStub(ch).Generate(request(prompt, 12), timeout=RPC_TIMEOUT)
        assert list(r.token_ids) == greedy_generate(ref_model, prompt, 12)
        assert r.spec_stats.num_drafts > 0
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 0, f"tandem serve exited with {rc} on SIGTERM:\n{log.read_text()[-6000:]}"
        t_end = time.monotonic() + 10          # its children were waited for; allow the reaping to finish
        while _session_alive(proc.pid) and time.monotonic() < t_end:
            time.sleep(0.2)
        assert not _session_alive(proc.pid), "processes of `tandem serve` are left after it exited"
    finally:
        if proc.poll() is None:
            proc.kill()
        if _session_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
