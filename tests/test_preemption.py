"""A KV cache too small for the load (gateway/preemption.py). Through the REST API of a real local cluster (CPU,
K = 3): concurrent requests that together need several times the target's blocks all finish, each with the
tokens plain decoding of its prompt alone gives; the gateway preempted (recomputed) some of them and held
admission back, where before every request of a round whose Verify found no room failed with a 503.
Afterwards both services hold no request and every block is free. Then the scheduler's rules over fake
services with a capacity (both ways of running out: Verify steps, and a first Prefill too large)."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from cluster import Cluster, make_checkpoint, serve_module
from gateway.scheduler import Scheduler
from infra.errors import KV_CACHE_FULL
from test_faults import metric
from tandem.v1 import target_pb2
from test_scheduler_faults import NEXT, FakeDraft, FakeTarget, events, request, rpc_error, run

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


# --- the scheduler's rules, over the fake services of test_scheduler_faults.py with a KV capacity -------------



class SmallTarget(FakeTarget):
    """Holds at most `capacity` positions: a request holds its prompt, then k + 1 more a Verify; a call that would
    pass the capacity fails as the target's does, before it changes anything."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.held, self.refused = capacity, {}, {"Prefill": 0, "Verify": 0}

    def _room(self, call: str, need: dict) -> None:
        if sum(self.held.values()) + sum(need.values()) > self.capacity:
            self.refused[call] += 1
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{KV_CACHE_FULL}: step needs more blocks")

    async def Prefill(self, req, timeout=None):
        self._room("Prefill", {it.request_id: len(it.prompt_token_ids) for it in req.items})
        resp = await super().Prefill(req, timeout)
        self.held.update({it.request_id: len(it.prompt_token_ids) for it in req.items})
        return resp

    async def Verify(self, req, timeout=None):
        """A Prefill riding it that does not fit is refused alone (VerifyResponse.prefill_status); the Verify runs."""
        self._room("Verify", {it.request_id: len(it.draft_token_ids) + 1 for it in req.items})
        pre, refused = (req.prefill if req.HasField("prefill") else None), None
        if pre is not None:
            try:
                self._room("Prefill", {it.request_id: len(it.prompt_token_ids) for it in pre.items})
            except grpc.aio.AioRpcError as e:
                refused = target_pb2.CallStatus(code=e.code().value[0], message=e.details())
                req = target_pb2.VerifyRequest.FromString(req.SerializeToString())
                req.ClearField("prefill")
        resp = await super().Verify(req, timeout)
        for it in req.items:
            self.held[it.request_id] += len(it.draft_token_ids) + 1
        if refused is not None:
            resp.prefill_status.CopyFrom(refused)
        elif pre is not None:
            self.held.update({it.request_id: len(it.prompt_token_ids) for it in pre.items})
        return resp

    async def Release(self, req, timeout=None):
        for rid in req.request_ids:
            self.held.pop(rid, None)
        return await super().Release(req, timeout)


async def drive(s: Scheduler, reqs, steps: int = 400):
    for r in reqs:
        s.submit(r)
    for _ in range(steps):
        if not s.running and not s.waiting and not s.prefilling:
            break
        await s.step()
    await asyncio.sleep(0.2)                          # the Release tasks run


@pytest.mark.parametrize("prompt_len", [3, 20])
def test_a_full_cache_preempts_and_holds_admission_back_and_every_request_finishes(prompt_len):
    """Capacity 64 positions, four requests of prompt_len + 24 tokens (K = 3): with short prompts the Verify
    steps run out of room (preemption), with long ones the first Prefill of all four does (admission). Every
    request ends with its 24 tokens and no error, and nothing is left on the target."""
    async def main():
        target, draft = SmallTarget(64), FakeDraft()
        s = Scheduler(target, draft, {2})
        reqs = [request(s, tuple(range(3, 3 + prompt_len)), max_tokens=24, k=3) for _ in range(4)]
        await drive(s, reqs)
        return s, target, reqs
    s, target, reqs = run(main())
    for r in reqs:
        assert r.finished and r.output_ids == [NEXT] * 24 and not any(e.error for e in events(r)), r
    assert target.held == {}, target.held
    assert s.preemptions > 0 and target.refused["Verify"] > 0, (s.preemptions, target.refused)
    if prompt_len == 20:
        assert target.refused["Prefill"] > 0, target.refused
