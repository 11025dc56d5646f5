"""Chunked prefill through the REST API of a local cluster: one target and one draft (prefix caching on,
K = 4) behind two gateways, `--max-num-batched-tokens 7` (chunks of 7 positions, not a block multiple)
and `--max-num-batched-tokens 0` (whole prompts).

The tokens are the same through both, greedy (and equal to the model's own greedy decoding) and seeded
sampling, for requests asking k = 0..4 drafts, with each prompt sent cold to one gateway and then as a prefix
hit to the other. Streams running on the chunked gateway keep getting tokens while a long prompt is
prefilled (counted between the long request's send and its first token: one round per chunk). A partly
prefilled request whose client goes away leaves nothing held: every KV block is free when idle."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import torch

from cluster import Cluster, make_checkpoint, serve_module
from test_faults import metric
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate

pytestmark = pytest.mark.slow
BUDGET = 7


@pytest.fixture(scope="module")
def cl(tmp_path_factory, request):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("chunk-ckpt") / "tiny", seed=13)
    with Cluster(ckpt, k=4, log_dir=tmp_path_factory.mktemp("chunk-logs"),
                 gateways=[{"name": "gateway-chunked", "args": ["--max-num-batched-tokens", str(BUDGET)]},
                           {"name": "gateway-whole", "args": ["--max-num-batched-tokens", "0"]}]) as c:
        c.ckpt = ckpt
        yield from serve_module(c, request)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(url: str, prompt: list[int], k: int, temperature: float, seed: int, max_tokens: int = 16) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "ignore_eos": True, "return_token_ids": True, "num_speculative_tokens": k}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_chunks_give_the_tokens_of_whole_prompts(cl):
    chunked, whole = (g.http_url for g in cl.gateways)
    model = load_model(TargetModel, cl.ckpt)
    for k in range(5):
        for temperature in (0.0, 0.8):
            prompt = ids(30 + 9 * k, 100 * k + int(temperature * 10))      # 30..66 tokens: 5..10 chunks
            order = (chunked, whole) if k % 2 else (whole, chunked)         # cold on one, prefix hit on the other
            got = [complete(url, prompt, k, temperature, seed=k) for url in order]
            assert got[0] == got[1], (k, temperature)
            if temperature == 0:
                assert got[0] == greedy_generate(model, prompt, 16), k
    cl.wait_drained()


def stream(url: str, prompt: list[int], max_tokens: int, log: list, name: str, stop: threading.Event,
           lock: threading.Lock) -> None:
    """A streamed completion; each token's arrival goes into `log` as (name, count); ends when `stop` is set."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "num_speculative_tokens": 2}
    with httpx.Client(timeout=300) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:]).get("choices", []))
                if not n:
                    continue
                with lock:
                    log.append((name, n))
            if stop.is_set():
                return                                   # the client goes away: the gateway cancels
    with lock:
        log.append((name, "end"))


def test_running_streams_get_tokens_between_the_chunks_of_a_long_prompt(cl):
    url = cl.gateways[0].http_url
    log, lock, stop = [], threading.Lock(), threading.Event()
    streams = [threading.Thread(target=stream, args=(url, ids(8, 900 + i), 2000, log, f"s{i}", stop, lock))
               for i in range(3)]
    for t in streams:
        t.start()
    while len({name for name, _ in list(log)}) < 3:      # all three are running
        time.sleep(0.05)
    long = ids(350, 950)                                   # 50 chunks of 7
    rode = metric(url, "tandem:num_prefills_in_verify")
    with lock:
        log.append(("long", "sent"))
    t = threading.Thread(target=stream, args=(url, long, 2, log, "long", threading.Event(), lock))
    t.start()
    t.join(timeout=300)
    stop.set()
    for s in streams:
        s.join(timeout=300)
    sent = log.index(("long", "sent"))
    first = next(i for i, (name, n) in enumerate(log) if name == "long" and isinstance(n, int))
    assert not [e for e in log[:first] if e[1] == "end"], "a stream ended before the long prompt's first token"
    between = {f"s{i}": sum(n for name, n in log[sent:first] if name == f"s{i}" and isinstance(n, int))
               for i in range(3)}
    print(f"tokens of each running stream while a {len(long)}-token prompt was prefilled in chunks of "
          f"{BUDGET}: {between}")
    assert all(n >= 40 for n in between.values()), between          # >= 1 a round, 50 rounds
    assert metric(url, "tandem:num_prefills_in_verify") - rode >= 45    # its chunks rode the rounds' Verifies
    cl.wait_drained()


def running(url: str) -> float:
    m = re.search(r"^tandem:num_requests_running\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1))


def test_a_partly_prefilled_request_whose_client_leaves_frees_everything(cl):
    url = cl.gateways[0].http_url
    body = {"model": "tiny", "prompt": ids(1400, 77), "max_tokens": 4, "stream": True, "return_token_ids": True}
    with httpx.Client(timeout=300) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 60
        while running(url) < 1 and time.monotonic() < deadline:      # admitted: prefilling, 200 chunks
            time.sleep(0.02)
        assert running(url) == 1
    cl.wait_drained()
    assert running(url) == 0
