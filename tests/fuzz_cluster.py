"""One local cluster for the hostile-input tests (test_fuzz_services.py, test_fuzz_api.py), shared through
the session-scoped `fuzz_cluster` fixture (conftest.py exposes it), and the checks every fuzzed call
must pass. This is a helper, not a test file.

The cluster: make_checkpoint's tiny model (vocab 512, hidden 64), K = 2, gloo bridge, small limits so
the fuzzers reach them: services `--max-message-bytes 1 MiB`, gateway `--max-prompt-tokens 64
--max-output-tokens 16 --max-request-bytes 64 KiB --default-max-tokens 8`.

The rules (issue 8, item 5): a call either succeeds — and then every token id it returns is in
[0, vocab) and every float it returns is finite — or fails with a client-error status (never
INTERNAL / UNKNOWN, never a 5xx on REST); afterwards every process is alive and SERVING, and once
the fuzzers' requests are released both KV pools are back to idle.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st

from cluster import SERVING, Cluster, make_checkpoint, serve_module
from tandem.v1 import common_pb2, generate_pb2, rows_pb2, target_pb2

VOCAB, HIDDEN, K = 512, 64, 2
MAX_PROMPT, MAX_OUTPUT, MAX_REQUEST_BYTES, SERVICE_MAX_BYTES = 64, 16, 64 << 10, 1 << 20
# statuses a bad request may get; INTERNAL / UNKNOWN (a crash in a handler) and UNAVAILABLE never
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.ALREADY_EXISTS}
TIMEOUT = 60
INLINE, BRIDGE = rows_pb2.TRANSPORT_INLINE, rows_pb2.TRANSPORT_BRIDGE
LIVE = "fz-live"                           # the fuzzers' one real request (released after every example)
PROMPT = [5, 77, 301, 12, 9]


def sometimes(valid, hostile):
    """`valid` three times in four, else `hostile`: most requests get past their first check and reach
    the deeper ones. (st.one_of(v, v, v, h) would not do: it drops repeated strategies, giving 50/50.)"""
    return st.integers(0, 3).flatmap(lambda i: hostile if i == 0 else valid)


def fuzz_settings(n: int):
    """Bounded, reproducible runs (CI); TANDEM_FUZZ_EXAMPLES scales every count, TANDEM_FUZZ_RANDOM=1 explores."""
    scale = float(os.environ.get("TANDEM_FUZZ_EXAMPLES", "1"))
    return settings(max_examples=max(1, int(n * scale)), deadline=None, database=None, print_blob=True,
                    derandomize=os.environ.get("TANDEM_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


def expect_client_error(e: grpc.RpcError, what: str) -> None:
    assert e.code() in CLIENT_ERRORS, f"{what}: {e.code().name}: {e.details()}"


def assert_tokens(ids, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < VOCAB]
    assert not bad, f"{what}: token id {bad[0]} outside [0, {VOCAB})"


def assert_finite_probs(raw: bytes, what: str) -> None:
    if raw:
        q = np.frombuffer(raw, dtype="<f4")
        assert np.isfinite(q).all() and (q >= 0).all(), f"{what}: draft probabilities hold NaN, inf or negatives"


def prefill_live(c, s: rows_pb2.SamplingParams, transport=INLINE) -> target_pb2.PrefillResponse:
    """Start LIVE on the target (PROMPT, sampling s), asking for its hidden rows."""
    return c.target.Prefill(target_pb2.PrefillRequest(
        items=[target_pb2.PrefillItem(request_id=LIVE, prompt_token_ids=PROMPT, sampling=s)],
        return_hidden_rows=True, transport=transport), timeout=TIMEOUT)


@dataclass
class FuzzCluster:
    cluster: Cluster
    ckpt: Path
    url: str                                  # the gateway's REST base

    def __getattr__(self, name):              # target, draft, gateways, dead(), logs() ... of the cluster
        return getattr(self.cluster, name)

    @property
    def generate(self):
        return self.cluster.gateways[0].stub

    def assert_healthy(self) -> None:
        assert not self.cluster.dead(), f"processes died: {self.cluster.dead()}"
        for name, addr in self.cluster.addrs().items():
            assert self.cluster.health(addr) == SERVING, f"{name} is not SERVING"

    def release(self, ids) -> None:
        if ids:
            self.cluster.release(sorted(ids))

    def greedy(self, prompt: list[int], n: int = 12) -> list[int]:
        return list(self.generate.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=n, ignore_eos=True), timeout=TIMEOUT).token_ids)

    def info(self, stub) -> common_pb2.InfoResponse:
        return stub.GetInfo(common_pb2.InfoRequest(), timeout=TIMEOUT)


@pytest.fixture(scope="session")
def fuzz_cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("fuzz-ckpt") / "tiny", seed=23)
    gw_args = ["--max-prompt-tokens", str(MAX_PROMPT), "--max-output-tokens", str(MAX_OUTPUT),
               "--max-request-bytes", str(MAX_REQUEST_BYTES), "--default-max-tokens", "8", "--stats-interval", "0"]
    with Cluster(ckpt, k=K, log_dir=tmp_path_factory.mktemp("fuzz-logs"),
                 extra_service_args=["--max-message-bytes", str(SERVICE_MAX_BYTES)],
                 gateways=[{"name": "gateway-fuzz", "args": gw_args}]) as c:
        yield from serve_module(FuzzCluster(c, ckpt, c.gateways[0].http_url), request)
