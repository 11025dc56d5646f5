"""A gateway's shutdown (SIGTERM; SIGINT outside `tandem serve`): it drains before it stops.

At the first signal the gateway stops admitting (HTTP 503 / gRPC UNAVAILABLE naming the shutdown, /health 503,
gRPC health NOT_SERVING: a load balancer moves on) and lets the requests it holds run to their end, for at most
--drain-timeout seconds. Those still running then, or at a second signal, fail with UNAVAILABLE: a REST stream
ends with an error event and a gRPC stream with that status, instead of a connection cut mid-response. Their KV
blocks are released on both services as for any failure (gateway/ending.py)."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("tandem.gateway")
STOPPING = "the gateway is shutting down"
SETTLE_S = 5.0          # for the failed requests' answers to reach their clients


def held(scheduler) -> int:
    return len(scheduler.waiting) + len(scheduler.prefilling) + len(scheduler.running)


async def drain(scheduler, timeout_s: float, again: asyncio.Event) -> int:
    """Refuse new requests, wait for those held (at most timeout_s, or until `again` is set), then fail the rest
    -> how many were failed."""
    loop = asyncio.get_running_loop()
    scheduler.avail.stopping = STOPPING
    if n := held(scheduler):
        log.info("shutting down: refusing new requests, draining %d (at most %.0f s, --drain-timeout; signal again "
                 "to stop now)", n, timeout_s)
    end = loop.time() + timeout_s
    while held(scheduler) and not again.is_set() and (left := end - loop.time()) > 0:
        try:
            await asyncio.wait_for(again.wait(), timeout=min(0.1, left))
        except asyncio.TimeoutError:
            pass
    if not (n := held(scheduler)):
        return 0
    log.warning("shutting down: failing the %d requests still running (UNAVAILABLE)", n)
    scheduler.avail.stopped = True              # the loop's next step fails them (it runs while any is held)
    scheduler.inflight.cut(STOPPING)            # ... and the call in flight is cut short
    end = loop.time() + SETTLE_S
    while held(scheduler) and loop.time() < end:
        await asyncio.sleep(0.05)
    return n
