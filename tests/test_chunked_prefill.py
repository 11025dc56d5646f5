"""Chunked prefill mixed into rounds (gateway/chunking.py), through the gateway's own Scheduler over the real
target and draft servicers in this process (tandem/inprocess.py): the calls are recorded in order.

A long prompt arriving while streams run is prefilled one budgeted chunk per step, and the running streams
get tokens between its chunks; every Prefill stays within --max-num-batched-tokens; the tokens equal the
target's greedy decoding with or without chunks; a partly prefilled request that is cancelled (in or out of
a call) or passes its deadline is released on both services; a draft failing on a chunk costs drafts, not
tokens; a target failing mid-prompt ends the requests with UNAVAILABLE and leaves nothing held."""
import asyncio
import time

import grpc
import pytest
import torch

from gateway.lanes import rpc_error
from gateway.request import GenRequest, Observer
from gateway.scheduler import Scheduler
from gateway.text import TextStream
from models.runner import greedy_generate
from tandem.inprocess import servicer_stubs
from tandem.v1 import rows_pb2
from test_engines import engines, make_models


@pytest.fixture(scope="module")
def models():
    return make_models()


class Ids:
    def decode(self, ids):
        return ""


class Recorded:
    """A stub whose calls go into `log` in order; `fail(method, request)` True: raise `code` instead."""

    def __init__(self, stub, name, log, fail=None, code=grpc.StatusCode.UNAVAILABLE, before=None):
        self._stub, self._name, self._log, self._fail, self._code, self._before = stub, name, log, fail, code, before

    def __getattr__(self, method):
        inner = getattr(self._stub, method)

        async def call(request, timeout=None, **_):
            self._log.append((self._name, method, request))
            if self._before:
                self._before(method, request)
            if self._fail and self._fail(method, request):
                raise rpc_error(self._code, f"injected {self._name} {method} failure")
            return await inner(request, timeout=timeout)
        return call


class Tokens(Observer):
    def __init__(self, log):
        self.log = log

    def tokens(self, r, n, now):
        self.log.append(("tokens", r.id, n))


def prompt(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(s, ids, k, max_tokens, deadline=None):
    return GenRequest(id=s.new_id(), prompt_ids=ids, max_tokens=max_tokens, sampling=rows_pb2.SamplingParams(),
                      text=TextStream(Ids(), []), ignore_eos=True, k=k, deadline=deadline)


async def drain(r):
    """r's events until it ends -> (tokens, error or None)."""
    toks = []
    while True:
        e = await asyncio.wait_for(r.events.get(), 120)
        toks += e.token_ids
        if e.error or e.finish_reason:
            return toks, e.error


def cluster(models, budget, fail_t=None, fail_d=None, before=None, prefix=False, code=grpc.StatusCode.UNAVAILABLE,
            mixed=True):
    te, de = engines(*models, blocks=96)
    if prefix:
        te.cache.enable_prefix_cache("target", 0)
        de.cache.enable_prefix_cache("draft", 1)
    t, d = servicer_stubs(te, de)
    log = []
    s = Scheduler(Recorded(t, "target", log, fail_t, code, before), Recorded(d, "draft", log, fail_d, code), set(),
                  max_batch=8, transport=rows_pb2.TRANSPORT_BRIDGE, observer=Tokens(log), max_num_batched_tokens=budget,
                  mixed_prefill=mixed)
    return te, de, s, log


def prefill_of(method, req):
    """The Prefill a recorded call carries: the call's own, one riding a Verify (VerifyRequest.prefill), or None."""
    if method == "Prefill":
        return req
    return req.prefill if method == "Verify" and req.HasField("prefill") else None


def prefills_of(log, rid) -> list[tuple[int, object]]:
    """(log index, PrefillRequest) of every prefill that names request `rid`, alone or riding a Verify."""
    return [(i, p) for i, (_, m, req) in enumerate(log) if (p := prefill_of(m, req)) is not None
            and any(it.request_id == rid for it in p.items)]


async def settle(s, te, de):
    while s.running or s.waiting or s.prefilling:
        await asyncio.sleep(0)
    for _ in range(20):                   # the Release calls run as tasks
        await asyncio.sleep(0)
    assert te.requests == {} and te.partial == {} and de.committed == {}
    assert te.cache.num_free_blocks == te.cache.num_blocks and de.cache.num_free_blocks == de.cache.num_blocks


def long_prompt_while_streaming(models, budget, k=2, prefix=False, mixed=True):
    """Three streams run; a 100-token prompt arrives -> (tokens per request, log, the long request's id)."""
    te, de, s, log = cluster(models, budget, prefix=prefix, mixed=mixed)

    async def main():
        loop = asyncio.ensure_future(s.run())
        short = [request(s, prompt(6 + i, i), k, 48) for i in range(3)]
        for r in short:
            s.submit(r)
        firsts = [await r.events.get() for r in short]          # all three are running
        long = request(s, prompt(100, 9), k, 8)
        s.submit(long)
        done = await asyncio.gather(*[drain(r) for r in short + [long]])
        await settle(s, te, de)
        loop.cancel()
        return [f.token_ids + t for f, (t, _) in zip(firsts, done[:3])] + [done[3][0]], [short, long]
    out, (short, long) = asyncio.run(main())
    return out, log, short, long


@pytest.mark.parametrize("k,mixed", [(0, True), (3, True), (3, False)])
def test_streams_get_tokens_between_the_chunks_of_a_long_prompt(models, k, mixed):
    """mixed: each chunk rides a round's Verify (one forward); else a Prefill call of its own before the round."""
    out, log, short, long = long_prompt_while_streaming(models, 16, k, prefix=k > 0, mixed=mixed)
    prefills = [i for i, _ in prefills_of(log, long.id)]
    assert len(prefills) == 7                                    # 100 positions, 16 a step
    assert all(log[i][1] == ("Verify" if mixed else "Prefill") for i in prefills)   # streams were running
    for i, p in prefills_of(log, long.id):
        assert sum(it.max_chunk_tokens for it in p.items) <= 16
    for a, b in zip(prefills, prefills[1:]):                     # each running stream moved between two chunks
        got = {e[1] for e in log[a:b] if e[0] == "tokens"}
        assert {r.id for r in short} <= got, (a, b)
    if k:                                                        # the draft was fed each chunk but the last
        feeds = [req for who, m, req in log if m == "Propose" and any(
            it.request_id == long.id and it.num_draft_tokens == 0 for it in req.items)]
        assert len(feeds) == 6
    target = models[0]
    for r, toks in zip(short + [long], out):
        assert toks == greedy_generate(target, r.prompt_ids, len(toks)), r.id


def test_without_a_budget_the_prompt_is_prefilled_whole(models):
    out, log, short, long = long_prompt_while_streaming(models, 0)
    prefills = [p for _, p in prefills_of(log, long.id)]
    assert len(prefills) == 1 and prefills[0].items[0].max_chunk_tokens == 0
    assert out[3] == greedy_generate(models[0], long.prompt_ids, len(out[3]))


@pytest.mark.parametrize("mixed", [False, True])
def test_partly_prefilled_requests_cancelled_or_expired_leave_nothing(models, mixed):
    """Three 40-token prompts (budget 8: one chunk a step, the oldest partial prompt first) while a stream
    runs: one cancelled while its third chunk is in the Prefill, one cancelled during a round after two
    chunks, one past its deadline after its first chunk. The stream finishes; nothing is left held. (mixed: the
    chunks ride the rounds' Verifies, so the second is in that call when cancelled: its third chunk lands first.)"""
    box = {"seen": {}}

    def before(method, req):
        if "reqs" not in box:
            return
        s, (a, b, c) = box["s"], box["reqs"]
        pre = prefill_of(method, req)
        if pre is not None:
            for r in (a, c):
                box["seen"][r.id] = box["seen"].get(r.id, 0) + any(it.request_id == r.id for it in pre.items)
            if box["seen"][a.id] == 3 and not a.cancelled:
                s.cancel(a)                                       # in flight: finished when the call returns
            if box["seen"][c.id] == 1:
                c.deadline = time.monotonic() - 1                 # expires before the next step
        if method == "Verify" and b.prefilled == 16 and not b.finished:
            s.cancel(b)                                           # in no call: released at once
    te, de, s, log = cluster(models, 8, before=before, mixed=mixed)
    box["s"] = s

    async def main():
        loop = asyncio.ensure_future(s.run())
        runner = request(s, prompt(5, 1), 2, 60)
        s.submit(runner)
        await runner.events.get()
        box["reqs"] = reqs = [request(s, prompt(40, 2 + i), 2, 8) for i in range(3)]
        for r in reqs:
            s.submit(r)
        _, expired = await drain(reqs[2])
        toks, err = await drain(runner)
        await settle(s, te, de)
        loop.cancel()
        return err, expired, reqs
    err, expired, reqs = asyncio.run(main())
    assert err is None and expired[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [r.prefilled for r in reqs] == [24, 24 if mixed else 16, 8] and all(r.finished for r in reqs)
    released = {i for who, m, req in log if m == "Release" for i in req.request_ids}
    assert {r.id for r in reqs} <= released


def test_a_draft_failing_on_a_chunk_costs_drafts_not_tokens(models):
    te, de, s, log = cluster(models, 16, fail_d=lambda m, req: m == "Propose" and any(
        it.num_draft_tokens == 0 for it in req.items))

    async def main():
        loop = asyncio.ensure_future(s.run())
        r = request(s, prompt(50, 3), 3, 12)
        s.submit(r)
        toks, err = await drain(r)
        await settle(s, te, de)
        loop.cancel()
        return r, toks, err
    r, toks, err = asyncio.run(main())
    assert err is None and s.avail.degraded is not None
    assert toks == greedy_generate(models[0], r.prompt_ids, 12)


@pytest.mark.parametrize("fail", [False, True])
def test_a_request_asking_no_drafts_gives_the_draft_its_prompt_and_never_fails_for_it(models, fail):
    """k = 0, its 50-token prompt in 16-token chunks, beside a speculating request (fail: alone, so its feeds go in
    Proposes of their own): every chunk and the last one with its first token go to the draft as items asking no
    drafts (its prefix cache then holds the prompt), and nothing of it after; a contract error on such a feed
    stops the feeds and fails nothing (it wanted no drafts). (In a round's Propose the round's rules apply.)"""
    te, de, s, log = cluster(models, 16, fail_d=(lambda m, req: m == "Propose") if fail else None,
                             code=grpc.StatusCode.INVALID_ARGUMENT)

    async def main():
        loop = asyncio.ensure_future(s.run())
        reqs = ([] if fail else [request(s, prompt(6, 1), 2, 16)]) + [request(s, prompt(50, 3), 0, 12)]
        for r in reqs:
            s.submit(r)
        out = [await drain(r) for r in reqs]
        await settle(s, te, de)
        loop.cancel()
        return reqs, out
    reqs, out = asyncio.run(main())
    plain = reqs[-1]
    assert [err for _, err in out] == [None] * len(reqs)
    assert out[-1][0] == greedy_generate(models[0], plain.prompt_ids, 12)
    fed = [it for who, m, req in log if who == "draft" and m == "Propose" for it in req.items
           if it.request_id == plain.id]
    assert fed and all(it.num_draft_tokens == 0 for it in fed)
    if fail:
        assert len(fed) == 1 and s.avail.degraded is None          # its first chunk refused, then no more
    else:
        assert reqs[0].stats.num_drafts > 0
        assert sum(len(it.new_token_ids) for it in fed) == 50 + 1    # the prompt and the first token, once
        assert fed[-1].position + len(fed[-1].new_token_ids) == 51


def test_a_target_failing_mid_prompt_ends_it_with_unavailable(models):
    calls = []

    def fail(method, req):
        calls.append(method)
        return method == "Prefill" and calls.count("Prefill") == 3
    te, de, s, log = cluster(models, 16, fail_t=fail)

    async def main():
        loop = asyncio.ensure_future(s.run())
        r = request(s, prompt(60, 4), 2, 12)
        s.submit(r)
        out = await drain(r)
        await settle(s, te, de)
        loop.cancel()
        return r, out
    r, (toks, err) = asyncio.run(main())
    assert toks == [] and err[0] == grpc.StatusCode.UNAVAILABLE and r.prefilled == 32


def test_the_budget_flag_is_checked_by_name_and_passed_on_by_tandem_serve():
    from gateway.config import parse
    from tandem import serve
    with pytest.raises(SystemExit, match=r"--max-num-batched-tokens must be >= 0 \(0: prompts prefilled whole\), got -1"):
        parse(["--random-config", "tiny", "--max-num-batched-tokens", "-1"])
    assert parse(["--random-config", "tiny", "--max-num-batched-tokens", "0"]).max_num_batched_tokens == 0
    cmds = {name: cmd for name, cmd, _ in serve.commands(serve.parse(["--random-config", "tiny",
                                                                      "--max-num-batched-tokens", "96"]))}
    i = cmds["gateway"].index("--max-num-batched-tokens")
    assert cmds["gateway"][i + 1] == "96"


def test_a_prompt_whose_chunks_ride_then_go_alone_keeps_the_draft_in_step(models):
    """mixed: a long prompt's first chunks ride the rounds of a short stream, whose end leaves the next chunks to
    Prefill calls of their own while the Propose that fed the draft the last riding chunk is still out. That
    Propose's answer counts before the next chunk's (else the draft's pending tokens would skip a chunk): the draft
    takes every chunk in order, never refuses one, and the tokens equal greedy decoding."""
    te, de, s, log = cluster(models, 16, mixed=True)

    async def main():
        loop = asyncio.ensure_future(s.run())
        short = request(s, prompt(6, 1), 2, 3)
        s.submit(short)
        await short.events.get()
        long = request(s, prompt(100, 9), 2, 10)
        s.submit(long)
        out = [await drain(r) for r in (short, long)]
        await settle(s, te, de)
        loop.cancel()
        return short, long, out
    short, long, out = asyncio.run(main())
    assert [err for _, err in out] == [None, None] and s.avail.degraded is None
    kinds = [log[i][1] for i, _ in prefills_of(log, long.id)]
    assert "Verify" in kinds and kinds[-1] == "Prefill", kinds          # rode, then alone
    fed = [it for who, m, req in log if who == "draft" and m == "Propose" for it in req.items if it.request_id == long.id]
    assert [it.position for it in fed] == sorted(it.position for it in fed)
    assert all(a.position + len(a.new_token_ids) == b.position for a, b in zip(fed, fed[1:]))
    assert long.stats.num_drafts > 0
    assert out[1][0] == greedy_generate(models[0], long.prompt_ids, 10)


def test_a_failed_verify_ends_the_prompt_chunk_riding_it_and_requeues_new_ones(models):
    """mixed: the Verify carrying a begun prompt's second chunk and a new prompt fails INTERNAL. The round's stream
    and the begun prompt end with it (the target may have dropped that prompt's chunks); the new prompt waits again
    and later finishes with its greedy tokens; nothing is left held on either service."""
    seen = {"n": 0}

    def fail(method, req):
        pre = prefill_of(method, req)
        if method != "Verify" or pre is None or not any(it.max_chunk_tokens for it in pre.items):
            return False
        seen["n"] += 1
        return seen["n"] == 2                                    # the second chunk's Verify
    te, de, s, log = cluster(models, 32, fail_t=fail, code=grpc.StatusCode.INTERNAL)

    async def main():
        loop = asyncio.ensure_future(s.run())
        short = request(s, prompt(6, 1), 2, 40)
        s.submit(short)
        await short.events.get()
        long, new = request(s, prompt(60, 9), 2, 6), request(s, prompt(5, 4), 2, 6)
        s.submit(long)
        s.submit(new)
        out = [await drain(r) for r in (short, long, new)]
        await settle(s, te, de)
        loop.cancel()
        return new, out
    new, out = asyncio.run(main())
    assert [e[0] if e else None for _, e in out] == [grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL, None]
    assert out[2][0] == greedy_generate(models[0], new.prompt_ids, 6)
