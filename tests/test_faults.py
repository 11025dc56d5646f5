"""Faults injected into a real local cluster (target, draft, gateway as processes; gloo bridge, K=4).

The draft is SIGKILLed mid-stream and started again: the streams go on without drafts (speculation
degraded, /health still 200, the metric set), and once the draft is back the gateway re-syncs its
cache of the running requests and speculation resumes (acceptance counters move again); greedy
output equals K = 0 token for token through the whole episode. The same when the draft hangs
(SIGSTOP) under a gateway with --draft-timeout 1, and wakes again (SIGCONT). Clients that disconnect (REST),
cancel (gRPC) or run out of deadline free their KV blocks in both services promptly. KV-block
accounting is checked after each.

The checkpoint allows 8192 positions (make_checkpoint's tiny model with max_position_embeddings
raised; RoPE without scaling, so positions are exact) so the streams outlast a draft restart on a
slow machine: they are cancelled once the episode is over, and compared on what they produced.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from cluster import Cluster, make_checkpoint, serve_module
from tandem.v1 import generate_pb2 as gen, generate_pb2_grpc

pytestmark = pytest.mark.slow

K = 4
MAX_LEN = 8192
QUICK_S = 2.0          # "within one round" on a busy 2-core machine: a round here takes milliseconds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("faults-ckpt") / "tiny", seed=7)
    cfg = json.loads((path / "config.json").read_text())
    assert not cfg.get("rope_scaling"), "raising max_position_embeddings needs unscaled RoPE"
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": MAX_LEN}))
    return path


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory, request):
    with Cluster(ckpt, k=K, log_dir=tmp_path_factory.mktemp("faults-logs"),
                 gateways=[{"name": "gateway"}, {"name": "gateway-impatient", "args": ["--draft-timeout", "1"]}],
                 extra_service_args=["--max-model-len", str(MAX_LEN), "--num-blocks", "4096"]) as c:
        yield from serve_module(c, request)


# --- helpers -----------------------------------------------------------------------------------
def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.1):
    """Poll `cond` (state in other processes: nothing to await) until true; AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(poll_s)


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=10)
    return r.status_code, r.json()


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (a counter by its name without `_total`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if not line.startswith("#") and line.split("{")[0].split(" ")[0] in (name, name + "_total"))


class Stream:
    """A gRPC GenerateStream read on its own thread; tokens as they come; cancel() ends it."""

    def __init__(self, stub, prompt: list[int], k: int, max_tokens: int = MAX_LEN - 100):
        req = gen.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)
        req.token_ids.ids.extend(prompt)
        self.k, self.tokens, self.error = k, [], None
        self.call = stub.GenerateStream(req, timeout=300)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for m in self.call:
                self.tokens += m.token_ids
        except grpc.RpcError as e:
            self.error = e.code()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def cancel(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=30)
        assert self.error == grpc.StatusCode.CANCELLED, self.error


def drained_within(cluster, timeout_s: float = QUICK_S) -> float:
    t0 = time.monotonic()
    cluster.wait_drained(timeout_s=timeout_s)
    return time.monotonic() - t0


# --- draft down -> keep serving, then resume -------------------------------------------------
def test_draft_killed_mid_stream_keeps_serving_then_resumes(cluster):
    gw = cluster.gateways[0]
    url = gw.http_url
    prompts = [[10, 20, 30], [11, 12]]
    streams = [Stream(gw.stub, p, k) for p in prompts for k in (K, 0)]
    wait_until(lambda: all(len(s.tokens) >= 20 for s in streams) and metric(url, "tandem:spec_decode_num_drafts"),
               60, "streams under way with drafts")
    cluster.kill("draft")
    wait_until(lambda: health(url)[1]["speculation"]["state"] == "degraded", 10, "speculation degraded")
    code, body = health(url)
    assert code == 200 and body["status"] == "degraded", body
    assert metric(url, "tandem:speculation_degraded") == 1
    seen = [len(s.tokens) for s in streams]
    wait_until(lambda: all(len(s.tokens) > n + 20 for s, n in zip(streams, seen)), 30, "progress without the draft")
    drafts, accepted = metric(url, "tandem:spec_decode_num_drafts"), metric(url, "tandem:spec_decode_num_accepted_tokens")

    cluster.restart("draft")
    wait_until(lambda: health(url)[1]["speculation"]["state"] == "active", 30, "speculation resumed")
    wait_until(lambda: metric(url, "tandem:spec_decode_num_accepted_tokens") > accepted, 30, "drafts accepted again")
    assert metric(url, "tandem:spec_decode_num_drafts") > drafts
    assert metric(url, "tandem:draft_resynced_requests") >= len(prompts)      # the K>0 streams, while running
    assert all(s.running for s in streams), "a stream ended before the episode was over: make them longer"
    # the K=0 stream (one token a round) must pass the point where its K>0 twin resumed speculating
    resumed = [len(s.tokens) for s in streams]
    wait_until(lambda: all(len(s.tokens) > resumed[i - i % 2] + 20 for i, s in enumerate(streams)), 60,
               "the K=0 streams past the point where speculation resumed")
    for s in streams:
        s.cancel()
    for i in range(len(prompts)):
        spec, plain = streams[2 * i].tokens, streams[2 * i + 1].tokens
        n = min(len(spec), len(plain))
        assert n > resumed[2 * i] + 20, "compare past the point where speculation resumed"
        assert spec[:n] == plain[:n], f"prompt {i}: K={K} differs from K=0 at token " \
                                      f"{next(j for j in range(n) if spec[j] != plain[j])}"
    drained_within(cluster, 10)
    assert health(url)[0] == 200 and metric(url, "tandem:speculation_degraded") == 0


# --- cancellation and deadlines ----------------------------------------------------------------
def test_rest_disconnect_frees_kv_promptly(cluster):
    url = cluster.gateways[0].http_url
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(5):
            assert next(line for line in lines if line.startswith("data: "))
    assert drained_within(cluster) < QUICK_S


def test_rest_disconnect_before_a_whole_response_frees_kv_promptly(cluster):
    """Not streamed: a client that gives up (its read timeout) cancels its requests as a stream's does, rather
    than leaving them to run to max_tokens for nobody."""
    url = cluster.gateways[0].http_url
    body = {"prompt": [5, 6, 8], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "n": 2}
    before, aborted = metric(url, "tandem:generation_tokens"), aborts(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    assert drained_within(cluster) < QUICK_S
    assert metric(url, "tandem:generation_tokens") - before < 2 * 4000 / 2, "the requests ran on after the client left"
    assert aborts(url) == aborted + 2, "tandem:request_success_total{finished_reason=\"abort\"} did not count them"


def aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem:request_success_total{") and 'finished_reason="abort"' in line)


def test_grpc_cancel_frees_kv_promptly(cluster):
    s = Stream(cluster.gateways[0].stub, [8, 9], K, max_tokens=4000)
    wait_until(lambda: len(s.tokens) >= 10, 30, "tokens")
    s.cancel()
    assert drained_within(cluster) < QUICK_S


def test_grpc_deadline_fails_and_frees_kv_promptly(cluster):
    req = gen.GenerateRequest(max_tokens=4000, ignore_eos=True)
    req.token_ids.ids.extend([13, 14, 15])
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        cluster.gateways[0].stub.Generate(req, timeout=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.0 + QUICK_S
    assert drained_within(cluster) < QUICK_S
    ok = cluster.gateways[0].stub.Generate(gen.GenerateRequest(text="def f(x):", max_tokens=4), timeout=60)
    assert ok.usage.completion_tokens >= 1


# --- draft hangs -> Propose times out, keep serving, resume when it wakes ----------------------
def test_draft_hangs_then_wakes(cluster):
    gw = cluster.gateways[1]                             # --draft-timeout 1
    url = gw.http_url
    streams = [Stream(gw.stub, [17, 18, 19], k) for k in (K, 0)]
    wait_until(lambda: all(len(s.tokens) >= 20 for s in streams), 60, "streams under way")
    draft = cluster.proc("draft").popen.pid
    os.kill(draft, signal.SIGSTOP)
    try:
        wait_until(lambda: health(url)[1]["speculation"]["state"] == "degraded", 15, "degraded by a Propose timeout")
        seen = [len(s.tokens) for s in streams]
        wait_until(lambda: all(len(s.tokens) > n + 20 for s, n in zip(streams, seen)), 30, "progress while it hangs")
        accepted = metric(url, "tandem:spec_decode_num_accepted_tokens")
    finally:
        os.kill(draft, signal.SIGCONT)
    wait_until(lambda: health(url)[1]["speculation"]["state"] == "active", 30, "speculation resumed")
    wait_until(lambda: metric(url, "tandem:spec_decode_num_accepted_tokens") > accepted, 30, "drafts accepted again")
    resumed = len(streams[0].tokens)
    wait_until(lambda: len(streams[1].tokens) > resumed + 20, 60, "the K=0 stream past the resume point")
    for s in streams:
        s.cancel()
    spec, plain = streams[0].tokens, streams[1].tokens
    n = min(len(spec), len(plain))
    assert spec[:n] == plain[:n]
    drained_within(cluster, 10)


# --- a gateway started while its draft is down -------------------------------------------------
def test_gateway_starts_without_its_draft_then_speculates_once_it_serves(cluster, ckpt, tmp_path):
    """A draft that is down (or still loading) when the gateway starts does not keep the gateway from serving:
    past --draft-wait it serves without drafts (/health degraded), refuses a draft of another model that comes
    up at the draft's address, and speculates once the right draft serves. Greedy output equals K = 0 throughout."""
    from cluster import Proc, free_ports
    cluster.kill("draft")
    gport, hport = free_ports(2)
    cmd = list(cluster.proc("gateway").cmd)
    for flag, port in (("--grpc-port", gport), ("--http-port", hport)):
        cmd[cmd.index(flag) + 1] = str(port)
    late = Proc("gateway-late", cmd + ["--draft-wait", "1"], f"127.0.0.1:{gport}", tmp_path / "gateway-late.log")
    cluster._spawn(late)
    cluster.wait_serving(late, time.monotonic() + 60)
    url, stub = f"http://127.0.0.1:{hport}", generate_pb2_grpc.GenerateServiceStub(cluster.channel(late.addr))

    def complete(k: int) -> list[int]:
        req = gen.GenerateRequest(max_tokens=24, ignore_eos=True, num_speculative_tokens=k)
        req.token_ids.ids.extend([21, 22, 23])
        return list(stub.Generate(req, timeout=60).token_ids)
    state = health(url)[1]["speculation"]
    assert state["state"] == "degraded", state
    plain = complete(0)
    assert complete(K) == plain and metric(url, "tandem:spec_decode_num_drafts") == 0

    other = tmp_path / "other-model"                   # the same shapes, another config: another identity
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 2}))
    draft = cluster.proc("draft")
    wrong = Proc("draft-other-model", [str(other) if a == str(ckpt) else a for a in draft.cmd], draft.addr,
                 tmp_path / "draft-other.log")
    cluster._spawn(wrong)
    wait_until(lambda: "model_identity" in health(url)[1]["speculation"].get("reason", ""), 60,
               "the draft of another model refused by name")
    assert health(url)[1]["speculation"]["state"] == "degraded" and complete(K) == plain
    cluster.kill("draft-other-model")
    cluster.procs.remove(wrong)                         # (not one of the cluster's: its end is no fault)

    cluster.restart("draft")
    wait_until(lambda: health(url)[1]["speculation"]["state"] == "active", 30, "speculating once the draft serves")
    assert complete(K) == plain
    assert metric(url, "tandem:spec_decode_num_drafts") > 0
    cluster.kill("gateway-late")
    cluster.procs.remove(late)
    wait_until(lambda: health(cluster.gateways[0].http_url)[1]["speculation"]["state"] == "active", 30,
               "the cluster's own gateway speculating again")
