"""Prefix caching through the REST API of the shared local cluster (api_cluster.py; target and draft
with prefix caching on, their default): a second request sharing a ~1500-token prefix is prefilled
from both caches: its usage says so (prompt_tokens_details.cached_tokens), the target's and the draft's
tandem:prefix_cache_hits move by the shared full blocks, its greedy tokens equal the model's computed
in this process, and its first token comes in at most half the first request's time (measured ~0.02x
on a 2-core CPU: the bound has a wide margin; the H200 figures are tandem bench prefill's)."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import torch

from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate

pytestmark = pytest.mark.slow
BS = 16                                     # the cluster's --block-size (the services' default)


def counter(text: str, name: str, service: str) -> float:
    m = re.search(rf'^tandem:{name}_total{{[^}}]*service="{service}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def ttft(http: httpx.Client, model: str, prompt: list[int]) -> tuple[float, list[int], dict]:
    """-> (seconds to the first streamed token, greedy tokens, usage) of one streamed completion."""
    t0, first, toks, usage = time.perf_counter(), None, [], None
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices", []):
                if c.get("text") or c.get("token_ids"):
                    first = first or time.perf_counter()
                    toks += c.get("token_ids") or []
    return first - t0, toks, usage


def test_a_shared_prefix_is_served_from_both_caches(api_cluster):
    g = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, 500, (1500,), generator=g).tolist()
    a, b = prefix + [7, 8], prefix + [9, 10, 11]
    with httpx.Client(base_url=api_cluster.url, timeout=300) as http:
        before = http.get("/metrics").text
        t_a, toks_a, u_a = ttft(http, api_cluster.model_name, a)
        mid = http.get("/metrics").text
        t_b, toks_b, u_b = ttft(http, api_cluster.model_name, b)
        after = http.get("/metrics").text
    shared = len(prefix) // BS * BS                                    # 93 full blocks: 1488 tokens
    assert u_a["prompt_tokens_details"]["cached_tokens"] == 0
    assert u_b["prompt_tokens_details"]["cached_tokens"] == shared, u_b
    for service in ("target", "draft"):
        hits = [counter(t, "prefix_cache_hits", service) for t in (before, mid, after)]
        queries = [counter(t, "prefix_cache_queries", service) for t in (before, mid, after)]
        assert hits[1] == hits[0] and hits[2] - hits[1] >= shared, (service, hits)
        assert queries[2] - queries[1] >= len(b) - 1, (service, queries)
    print(f"time to first token: cold {t_a * 1e3:.0f} ms, prefix hit {t_b * 1e3:.0f} ms ({t_b / t_a:.2f}x)")
    assert t_b <= 0.5 * t_a, (t_a, t_b)
    model = load_model(TargetModel, api_cluster.ckpt)
    assert toks_b == greedy_generate(model, b, len(toks_b))


def test_a_prompt_that_asked_no_drafts_reaches_the_drafts_prefix_cache_too(api_cluster):
    """A request asking no drafts (num_speculative_tokens 0) is fed its prompt to the draft all the same
    (DraftState.prompt_only): a speculating request that shares the prefix then finds it in the draft's cache as
    well as the target's (the draft's hits move; without the feed the draft lacked it and the request's first round
    waited on a recovery, gateway/prefix_recovery.py), and its greedy tokens stay the model's."""
    g = torch.Generator().manual_seed(23)
    prefix = torch.randint(3, 500, (320,), generator=g).tolist()
    a, b = prefix + [7, 8], prefix + [9, 10, 11]
    with httpx.Client(base_url=api_cluster.url, timeout=300) as http:
        r = http.post("/v1/completions", json={"model": api_cluster.model_name, "prompt": a, "max_tokens": 4,
                                               "temperature": 0, "num_speculative_tokens": 0})
        assert r.status_code == 200, r.text
        mid = http.get("/metrics").text
        _, toks_b, u_b = ttft(http, api_cluster.model_name, b)
        after = http.get("/metrics").text
    shared = len(prefix) // BS * BS                                    # 20 full blocks
    assert u_b["prompt_tokens_details"]["cached_tokens"] == shared, u_b
    for service in ("target", "draft"):
        hits = [counter(t, "prefix_cache_hits", service) for t in (mid, after)]
        assert hits[1] - hits[0] >= shared, (service, hits)
    model = load_model(TargetModel, api_cluster.ckpt)
    assert toks_b == greedy_generate(model, b, len(toks_b))


def test_n_copies_of_a_prompt_are_prefilled_once(api_cluster):
    """n = 8 choices of one 640-token prompt: the first copy is prefilled, the other seven wait for it and find the
    prompt in both caches (the target's and the draft's hits move by 7 x its full blocks), and
    the greedy choices are the model's. (Found probing as a user: the copies were prefilled side by side in one
    step, none hitting the cache the first was filling: n = 16 cost 12.6x n = 1.)"""
    g = torch.Generator().manual_seed(29)
    prompt = torch.randint(3, 500, (640,), generator=g).tolist()
    with httpx.Client(base_url=api_cluster.url, timeout=300) as http:
        before = http.get("/metrics").text
        r = http.post("/v1/completions", json={"model": api_cluster.model_name, "prompt": prompt, "max_tokens": 4,
                                               "temperature": 0, "n": 8, "return_token_ids": True})
        after = http.get("/metrics").text
    assert r.status_code == 200, r.text
    shared = (len(prompt) - 1) // BS * BS                            # (the last position is computed: its logits)
    for service in ("target", "draft"):
        hits = [counter(t, "prefix_cache_hits", service) for t in (before, after)]
        assert hits[1] - hits[0] >= 7 * shared, (service, hits)
    model = load_model(TargetModel, api_cluster.ckpt)
    want = greedy_generate(model, prompt, 4)
    assert [c["token_ids"] for c in r.json()["choices"]] == [want] * 8
