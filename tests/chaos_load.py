"""Helpers of tests/test_chaos.py: a `tandem serve` tree of the bundled model on free ports, streaming
REST clients that record exactly what each stream carried, and the chaos schedule that SIGKILLs the
services `tandem serve` supervises. This is a helper, not a test file.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from cluster import REPO, free_ports, stop_serve
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

MODEL = REPO / "checkpoints" / "tandem-code-mini"


class ServeTree:
    """One `tandem serve` process tree (its supervisor restarts a target or draft that exits), its
    combined log in a file. Every process has one torch thread (the services' default)."""

    def __init__(self, log_path: Path, k: int = 3, num_blocks: int = 512):
        grpc_port, http_port, tport, dport, bport, dist = free_ports(6)
        self.url, self.log_path = f"http://127.0.0.1:{http_port}", log_path
        cmd = [sys.executable, "-m", "tandem", "serve", "--model", str(MODEL), "-k", str(k),
               "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--target-port", str(tport),
               "--draft-port", str(dport), "--bridge-port", str(bport), "--dist-port", str(dist),
               "--num-blocks", str(num_blocks), "--speculation", "fixed"]
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in (tport, dport)]
        self.target = target_pb2_grpc.TargetServiceStub(self.channels[0])
        self.draft = draft_pb2_grpc.DraftServiceStub(self.channels[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, name: str) -> int:
        """The latest pid `tandem serve` started `name` with."""
        return int(re.findall(rf"started {name} \(pid (\d+)\)", self.log())[-1])

    def kill(self, name: str) -> int:
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def infos(self) -> list[common_pb2.InfoResponse]:
        return [s.GetInfo(common_pb2.InfoRequest(), timeout=5) for s in (self.target, self.draft)]

    def idle(self) -> bool:
        """Both services hold no request and every KV block is free."""
        return all(i.running_requests == 0 and i.kv_blocks_free == i.kv_blocks_total for i in self.infos())

    def stop(self) -> None:
        stop_serve(self.proc, self.channels)


async def health(client: httpx.AsyncClient) -> tuple[int, str]:
    """(HTTP status of /health, the speculation state or "?"); (0, why) when the gateway does not answer."""
    try:
        r = await client.get("/health", timeout=5)
        return r.status_code, r.json().get("speculation", {}).get("state", "?")
    except (httpx.HTTPError, ValueError) as e:
        return 0, repr(e)


async def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Poll the async `cond` (state in other processes) until true; -> the monotonic time it was."""
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        await asyncio.sleep(poll_s)
    return time.monotonic()


# --- streams --------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one streamed completion carried, as its client saw it (times: monotonic seconds)."""
    prompt: str
    start: float
    end: float = 0.0
    status: int = 0                 # HTTP status; 0: no answer (an exception: `exc`)
    ids: list[int] = field(default_factory=list)      # token_ids of every chunk, concatenated
    text: str = ""                  # text of every chunk, concatenated
    finish: str | None = None
    error: dict | None = None       # the OpenAI error object of an error event or of a non-200 body
    retry_after: str | None = None
    done: int = 0                   # `data: [DONE]` lines seen
    after_done: int = 0             # data lines after the first [DONE] (there must be none)
    hung: bool = False              # no end within the per-stream deadline
    exc: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.finish in ("stop", "length")


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, deadline_s: float) -> Outcome:
    """One greedy streamed completion, every chunk recorded; bounded by `deadline_s` (then `hung`)."""
    out = Outcome(prompt, time.monotonic())
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}

    async def read():
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200:
                out.error = json.loads(await r.aread()).get("error")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if out.done:
                    out.after_done += 1
                if line == "data: [DONE]":
                    out.done += 1
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]
                    continue
                (c,) = chunk["choices"]
                out.ids += c.get("token_ids") or []
                out.text += c["text"]
                out.finish = c["finish_reason"] or out.finish
    try:
        await asyncio.wait_for(read(), deadline_s)
    except asyncio.TimeoutError:
        out.hung = True
    except (httpx.HTTPError, ValueError) as e:
        out.exc = repr(e)
    out.end = time.monotonic()
    return out


class Load:
    """n clients, each streaming completions in turn (prompts in rotation) until the monotonic time
    `until`; after a refusal a client waits its Retry-After (1 s) as a polite client would.
    `pause()` holds new streams back and returns once none is in flight; `resume()` lets them go."""

    def __init__(self, url: str, n: int, prompts: list[str], max_tokens: int, deadline_s: float):
        self.url, self.n, self.prompts, self.max_tokens, self.deadline_s = url, n, prompts, max_tokens, deadline_s
        self.results: list[Outcome] = []
        self.go = asyncio.Event()
        self.go.set()
        self.active = 0

    async def run(self, until: float) -> list[Outcome]:
        limits = httpx.Limits(max_connections=self.n + 4, max_keepalive_connections=self.n + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.deadline_s),
                                     limits=limits) as client:
            async def loop(c: int):
                i = c
                while True:
                    await self.go.wait()
                    if time.monotonic() >= until:
                        return
                    self.active += 1
                    try:
                        o = await stream(client, self.prompts[i % len(self.prompts)], self.max_tokens, self.deadline_s)
                    finally:
                        self.active -= 1
                    self.results.append(o)
                    i += 1
                    if o.hung or o.exc:
                        return
                    if o.status != 200:
                        await asyncio.sleep(float(o.retry_after or 1))
            await asyncio.gather(*(loop(c) for c in range(self.n)))
        return self.results

    async def pause(self, timeout_s: float) -> None:
        self.go.clear()

        async def drained():
            return self.active == 0
        await wait_for(drained, timeout_s, "the streams in flight ended")

    def resume(self) -> None:
        self.go.set()


# --- chaos ----------------------------------------------------------------------------------------
@dataclass
class Kill:
    name: str
    pid: int
    at: float                       # monotonic time of the SIGKILL
    noticed: float = 0.0            # the gateway reported it (/health: draft degraded, or 503)
    back: float = 0.0               # /health 200 with speculation active again


async def chaos(tree: ServeTree, load: Load, schedule: list[tuple[float, str]], t0: float, recover_s: float,
                checkpoint_lead_s: float) -> tuple[list[Kill], list[float]]:
    """SIGKILL each (seconds after t0, "draft" | "target") of `schedule`, then wait until the gateway
    noticed and `tandem serve` restarted it and /health is 200 with speculation active again.
    `checkpoint_lead_s` before every kill but the first (and so after each episode but the last):
    pause the load and check that both KV pools are idle (a leak the next kill would wipe shows
    here), then resume it. -> (the kills, the checkpoints' monotonic times)."""
    kills, checkpoints = [], []
    async with httpx.AsyncClient(base_url=tree.url) as client:
        for at, name in schedule:
            if kills:
                await asyncio.sleep(max(0.0, t0 + at - checkpoint_lead_s - time.monotonic()))
                await load.pause(load.deadline_s)

                async def idle():
                    return tree.idle()
                checkpoints.append(await wait_for(idle, 15, f"both KV pools idle after the {kills[-1].name} kill"))
                load.resume()
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            k = Kill(name, tree.kill(name), time.monotonic())
            kills.append(k)

            async def noticed():
                code, state = await health(client)
                return code == 503 if name == "target" else (code == 200 and state == "degraded")

            async def back():
                return await health(client) == (200, "active")
            k.noticed = await wait_for(noticed, 10, f"the gateway noticed the {name} SIGKILLed at {at}s", 0.05)
            k.back = await wait_for(back, recover_s, f"the {name} SIGKILLed at {at}s restarted and serving")
    return kills, checkpoints
