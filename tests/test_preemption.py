"""A KV cache too small for the load (gateway/preemption.py), through the REST API of a real local cluster (CPU,
K = 3): concurrent requests that together need several times the target's blocks all finish, each with the
tokens plain decoding of its prompt alone gives; the gateway preempted (recomputed) some of them and held
admission back, where before every request of a round whose Verify found no room failed with a 503.
Afterwards both services hold no request and every block is free."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster import Cluster, make_checkpoint, serve_module
from test_faults import metric

BLOCKS, MAX_LEN = 24, 160                    # 384 positions; each request below ends at 40 + 80 = 120 (8 blocks)
PROMPT_TOKENS, TOKENS, CONCURRENT = 40, 80, 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("preempt-ckpt") / "tiny", seed=5)
    with Cluster(ckpt, k=3, log_dir=tmp_path_factory.mktemp("preempt-logs"),
                 extra_service_args=["--num-blocks", str(BLOCKS), "--max-model-len", str(MAX_LEN)]) as c:
        yield from serve_module(c, request)


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 500 + 3 for j in range(PROMPT_TOKENS)]


async def complete(client: httpx.AsyncClient, ids: list[int], k: int, stream: bool) -> tuple[int, list[int], str]:
    body = {"prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "num_speculative_tokens": k, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        c = r.json()["choices"][0] if r.status_code == 200 else {"token_ids": [], "text": r.text}
        return r.status_code, c["token_ids"], c["text"]
    ids_out, text = [], ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if "error" in d:
                    return 500, ids_out, d["error"]["message"]
                ids_out += d["choices"][0].get("token_ids") or []
                text += d["choices"][0]["text"]
    return r.status_code, ids_out, text


def test_requests_that_overflow_the_kv_cache_all_finish_with_their_own_tokens(cluster):
    url = cluster.gateways[0].http_url
    before = metric(url, "tandem:num_preemptions")

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            together = await asyncio.gather(*(complete(c, prompt(i), 3, i % 2 == 0) for i in range(CONCURRENT)))
            alone = [await complete(c, prompt(i), 0, False) for i in range(CONCURRENT)]
        return together, alone
    together, alone = asyncio.run(main())
    for i, ((code, ids, text), (code0, ids0, text0)) in enumerate(zip(together, alone)):
        assert code == code0 == 200, (i, text, text0)
        assert len(ids) == TOKENS and ids == ids0 and text == text0, i
    assert metric(url, "tandem:num_preemptions") > before          # the cache did run out
    cluster.wait_drained()
