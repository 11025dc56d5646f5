"""Chaos under load (issue 19, item 5): `tandem serve` on the bundled model (CPU, loopback, K = 3) while
CLIENTS streaming REST clients send greedy completions in turn for DURATION_S, and the draft is
SIGKILLed twice and the target once (SCHEDULE; `tandem serve` restarts each).

Each prompt's K = 0 completion is taken first (`num_speculative_tokens: 0`). Afterwards:
* no stream hung: each ended within STREAM_DEADLINE_S (a stream normally takes a second or two);
* every stream either completed (finish_reason stop / length, one `data: [DONE]`, nothing after it)
  with token ids and text, concatenated over its chunks, equal to its prompt's K = 0 completion (a
  lost or repeated token fails here), or ended with a clear error, and only around the target kill:
  an SSE error event (code "unavailable", naming the target) then `data: [DONE]` within FAIL_FAST_S
  of the kill for a stream in flight, its tokens so far a prefix of the K = 0 completion; or HTTP
  503 with Retry-After and an OpenAI error body while the gateway held the target for down;
* both services hold no request and every KV block is free (GetInfo) at the end, and at a pause of
  the load (new streams held back until those in flight end) CHECKPOINT_LEAD_S before the second and
  the third kill: a block leaked by one episode would otherwise be wiped by the next restart;
* the supervisor logged each restart, and the cluster serves again: a fresh request, streamed and
  not, equals K = 0 and speculates (the drafts counter moves).
RELIABILITY.md ("Chaos under load") has a run's figures.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from chaos_load import Load, ServeTree, chaos, stream
from test_faults import metric, wait_until

pytestmark = pytest.mark.slow

CLIENTS = 32
DURATION_S = 60.0
MAX_TOKENS = 32
SCHEDULE = [(10.0, "draft"), (27.0, "target"), (44.0, "draft")]      # seconds after the load starts
STREAM_DEADLINE_S = 30.0
FAIL_FAST_S = 5.0
CHECKPOINT_LEAD_S = 7.0      # pause the load, both KV pools idle, resume: this long before the 2nd, 3rd kill
RECOVER_S = 60.0             # a restart: backoff (1 s, then 2 s) + loading the model on a busy machine
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
           "# utilities for paths\n", "for i in range(10):\n", "    return self._data[", "x = [", "while True:\n"]


@pytest.fixture
def tree(tmp_path, request):
    t = ServeTree(tmp_path / "serve.log")
    failed = request.session.testsfailed
    try:
        def healthy():
            assert t.proc.poll() is None, f"tandem serve exited:\n{t.log()[-6000:]}"
            try:
                r = httpx.get(t.url + "/health", timeout=5)
                return r.status_code == 200 and r.json()["speculation"]["state"] == "active"
            except httpx.HTTPError:
                return False
        wait_until(healthy, 240, "tandem serve healthy", poll_s=0.3)
        yield t
    finally:
        t.stop()
        if request.session.testsfailed > failed:
            print(f"\n===== tandem serve log =====\n{t.log()[-12000:]}")


def reference(url: str, prompt: str, k: int | None = 0) -> tuple[list[int], str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    if k is not None:
        body["num_speculative_tokens"] = k
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    return c["token_ids"], c["text"]


async def drive(tree: ServeTree):
    t0, load = time.monotonic(), Load(tree.url, CLIENTS, PROMPTS, MAX_TOKENS, STREAM_DEADLINE_S)
    running = asyncio.ensure_future(load.run(t0 + DURATION_S))
    kills, checkpoints = await chaos(tree, load, SCHEDULE, t0, RECOVER_S, CHECKPOINT_LEAD_S)
    results = await asyncio.wait_for(running, t0 + DURATION_S + 2 * STREAM_DEADLINE_S - time.monotonic())
    return t0, results, kills, checkpoints, time.monotonic() - t0


def test_chaos_under_load(tree):
    began = time.monotonic()
    ref = {p: reference(tree.url, p) for p in PROMPTS}
    t0, results, kills, checkpoints, wall = asyncio.run(drive(tree))

    assert not [o for o in results if o.hung], "a stream hung"
    assert not [o for o in results if o.exc], [o.exc for o in results if o.exc][:3]
    assert not [o for o in results if o.after_done], "data after data: [DONE]"
    completed = [o for o in results if o.completed]
    for o in completed:                                  # nothing lost, repeated or changed
        assert o.done == 1, o
        assert (o.ids, o.text) == ref[o.prompt], f"a completed stream differs from K=0: {o}"
    (target,) = [k for k in kills if k.name == "target"]
    mid, refused = [], []
    for o in (o for o in results if not o.completed):
        err = o.error or {}
        assert err.get("code") == "unavailable" and err.get("type") == "server_error" \
            and "target" in err.get("message", ""), f"not a clear error: {o}"
        if o.status == 200:                              # in flight when the target died: an error event
            mid.append(o)
            assert o.done == 1 and o.finish is None, o
            assert o.start <= target.noticed and target.at <= o.end <= target.at + FAIL_FAST_S, \
                f"a stream failed away from the target kill (t={o.end - t0:.1f}s; kills {kills}): {o}"
            want_ids, want_text = ref[o.prompt]
            assert o.ids == want_ids[:len(o.ids)] and want_text.startswith(o.text), o
        else:                                            # refused while the gateway held the target for down
            refused.append(o)
            assert o.status == 503 and o.retry_after, o
            assert target.at <= o.end and o.start <= target.back, \
                f"refused away from the target's downtime (t={o.end - t0:.1f}s; kills {kills}): {o}"
    assert mid, "the target kill hit no stream in flight"
    assert len(completed) >= 8 * CLIENTS, f"only {len(completed)} streams completed"

    wait_until(tree.idle, 15, "both KV pools idle (GetInfo) after the load")
    log = tree.log()
    assert log.count("draft exited with code -9; restarting it") == 2, log[-4000:]
    assert log.count("target exited with code -9; restarting it") == 1, log[-4000:]

    drafts = metric(tree.url, "tandem:spec_decode_num_drafts")         # serves again, speculating
    assert reference(tree.url, PROMPTS[0], k=None) == ref[PROMPTS[0]]

    async def one():
        async with httpx.AsyncClient(base_url=tree.url) as client:
            return await stream(client, PROMPTS[1], MAX_TOKENS, STREAM_DEADLINE_S)
    fresh = asyncio.run(one())
    assert fresh.completed and (fresh.ids, fresh.text) == ref[PROMPTS[1]], fresh
    assert metric(tree.url, "tandem:spec_decode_num_drafts") > drafts
    wait_until(tree.idle, 15, "both KV pools idle after the fresh requests")

    episodes = "; ".join(f"{k.name} at {k.at - t0:.0f}s (gateway noticed in {k.noticed - k.at:.2f}s, "
                         f"serving again after {k.back - k.at:.1f}s)" for k in kills)
    print(f"\nchaos: {CLIENTS} streaming clients for {wall:.0f}s (K=3, bundled model, CPU): {len(results)} streams, "
          f"{len(completed)} completed = K=0, {len(mid)} failed mid-stream with an error event, {len(refused)} "
          f"refused with 503 while the target was down, 0 hung; kills: {episodes}; KV pools idle at "
          f"{', '.join(f'{c - t0:.0f}s' for c in checkpoints)} (load paused) and at the end; "
          f"test {time.monotonic() - began:.0f}s")
