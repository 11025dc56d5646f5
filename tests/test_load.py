"""Load and back-pressure through the REST API of a real local cluster (CPU, loopback, K=3, gloo).

Load: CLIENTS concurrent streaming clients, each sending REQUESTS_PER_CLIENT completions in turn
(greedy, ignore_eos, max_tokens TOKENS, one of PROMPTS): zero errors, every stream ends with
`data: [DONE]` and carries exactly TOKENS tokens, each equal to the K = 0 completion of its prompt;
afterwards both services hold no request and every KV block is free. p50/p99 time to first token
and inter-token latency (a chunk's gap spread over its tokens, as the gateway's metric does) are
printed (run with -s; BENCHMARKS.md "Load (CPU)" has a run's numbers).

Back-pressure: a gateway with --max-batch 1 --max-waiting 2 refuses a request beyond its queue with
HTTP 429 (Retry-After) and gRPC RESOURCE_EXHAUSTED, and serves again once the queue drains.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time

import grpc
import httpx
import pytest

from cluster import Cluster, make_checkpoint, serve_module
from tandem.v1 import generate_pb2 as gen
from test_faults import metric, wait_until

pytestmark = pytest.mark.slow

K = 3
CLIENTS = 64
REQUESTS_PER_CLIENT = 4
TOKENS = 48
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
           "# utilities for paths\n", "for i in range(10):\n", "    return self._data[", "x = [", "while True:\n"]
LOAD_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("load-ckpt") / "tiny", seed=3)
    with Cluster(ckpt, k=K, log_dir=tmp_path_factory.mktemp("load-logs"),
                 gateways=[{"name": "gateway-load", "args": ["--stats-interval", "2"]},
                           {"name": "gateway-small", "max_batch": 1, "args": ["--max-waiting", "2"]}]) as c:
        yield from serve_module(c, request)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def one_stream(client: httpx.AsyncClient, prompt: str) -> dict:
    """-> {"ttft", "itl": [...], "ids", "done", "error"} of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    out = {"ttft": None, "itl": [], "ids": [], "done": False, "error": None}
    t0 = last = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]["message"]
                continue
            ids = chunk["choices"][0].get("token_ids") or []
            now = time.perf_counter()
            if ids and out["ttft"] is None:
                out["ttft"] = now - t0
            elif ids:
                out["itl"] += [(now - last) / len(ids)] * len(ids)
            if ids:
                last = now
            out["ids"] += ids
    return out


async def drive(url: str) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def client_loop(c: int):
            return [await one_stream(client, PROMPTS[(c + i) % len(PROMPTS)]) | {"prompt": PROMPTS[(c + i) % len(PROMPTS)]}
                    for i in range(REQUESTS_PER_CLIENT)]
        t0 = time.perf_counter()
        per_client = await asyncio.wait_for(asyncio.gather(*(client_loop(c) for c in range(CLIENTS))), LOAD_TIMEOUT_S)
        return [r for rs in per_client for r in rs], time.perf_counter() - t0


def test_load_64_streaming_clients(cluster):
    gw = cluster.gateways[0]
    results, wall = asyncio.run(drive(gw.http_url))
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, f"{len(errors)} of {len(results)} requests failed, e.g. {errors[:3]}"
    assert all(r["done"] for r in results), "a stream did not end with data: [DONE]"
    assert all(len(r["ids"]) == TOKENS for r in results), sorted({len(r["ids"]) for r in results})
    plain = {}
    for p in PROMPTS:                                    # lossless under load: each equals K = 0
        body = {"prompt": p, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "num_speculative_tokens": 0}
        plain[p] = httpx.post(gw.http_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    bad = [r["prompt"] for r in results if r["ids"] != plain[r["prompt"]]]
    assert not bad, f"{len(bad)} streams differ from K=0, e.g. for {bad[0]!r}"
    cluster.wait_drained(timeout_s=30)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    drafts, accepted = (metric(gw.http_url, f"tandem:spec_decode_num_{n}") for n in ("drafts", "accepted_tokens"))
    print(f"\nload: {CLIENTS} concurrent streaming clients x {REQUESTS_PER_CLIENT} requests x {TOKENS} tokens "
          f"(K={K}, CPU) in {wall:.1f}s: {len(results) * TOKENS / wall:.0f} tokens/s; "
          f"TTFT p50 {1000 * statistics.median(ttft):.0f} ms, p99 {1000 * pct(ttft, 99):.0f} ms; "
          f"ITL p50 {1000 * statistics.median(itl):.1f} ms, p99 {1000 * pct(itl, 99):.1f} ms; "
          f"mean acceptance length {1 + accepted / max(drafts, 1):.2f}; errors 0")


def test_queue_limit_answers_429_and_resource_exhausted(cluster):
    gw = cluster.gateways[1]                             # --max-batch 1 --max-waiting 2
    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=gw.http_url, timeout=60) as client, contextlib.ExitStack() as held:
        for expect_waiting in (0, 1, 2):                 # one running, then two queued behind it
            assert held.enter_context(client.stream("POST", "/v1/completions", json=body)).status_code == 200
            wait_until(lambda: metric(gw.http_url, "tandem:num_requests_waiting") == expect_waiting, 10,
                       f"{expect_waiting} waiting")
        r = client.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "resource_exhausted" and "--max-waiting" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            gw.stub.Generate(gen.GenerateRequest(text="x", max_tokens=2), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert metric(gw.http_url, "tandem:requests_rejected") >= 2
    # the clients are gone: the running request and the queued ones are freed
    cluster.wait_drained(timeout_s=10)
    ok = httpx.post(gw.http_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
