"""How the gateway's requests take their tokens and end (a mixin of gateway/scheduler.py's Scheduler): tokens are
committed only from the target's answers, in order, up to the first that ends the request; an ended request is
freed on both services (on the draft once no unanswered Propose names it); a failed one ends with an error event."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from gateway import proposals
from gateway.request import Event, GenRequest
from gateway.stubs import client_status
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.stubs import DraftStub, TargetStub

log = logging.getLogger("tandem.gateway")
RELEASE_RETRY_S = (1.0, 4.0, 15.0, 60.0)    # waits before a failed Release is sent again


class Ending:
    def _commit_all(self, batch: list[GenRequest], results) -> None:
        for r, res in zip(batch, results):
            r.uncommitted = 0
            self._commit(r, list(res.emitted_token_ids), list(res.logprobs))

    def _target_failed(self, reqs: list[GenRequest], e: grpc.aio.AioRpcError, call: str) -> None:
        """A Prefill or Verify failed: its requests end with the status (none is half-advanced: the
        gateway commits only what a call returned). UNAVAILABLE: the target is gone; refuse new requests."""
        if client_status(e) == grpc.StatusCode.UNAVAILABLE:
            self.target_lost(f"{call} failed: {e.details()}")
        for r in reqs:
            self.fail(r, client_status(e), f"target {call} failed: {e.details()}")

    def _commit(self, r: GenRequest, tokens: list[int], logprobs: list | None = None) -> None:
        """Commit the target's tokens in order up to the first that ends the request (EOS, one that
        completes a stop string, max_tokens): nothing after it is returned, so the completion
        (tokens, usage) does not depend on how many drafts a round accepted."""
        if r.finished:
            return
        new, text, finish = r.take(tokens, logprobs, self.eos)
        now = time.monotonic()
        self.obs.tokens(r, len(new), now)
        r.first_token_time = r.first_token_time or now
        r.last_token_time = now
        r.events.put_nowait(Event(new, text, finish, logprobs=list(logprobs or [])[:len(new)]))
        if finish:
            self._finish(r, finish)

    def _finish(self, r: GenRequest, reason: str | None) -> None:
        r.finished = True
        self.obs.finished(r, reason, time.monotonic())
        if r in self.running:
            self.running.remove(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
        self.freed += 1
        self.release(r)

    def release(self, r: GenRequest) -> None:
        """Free r's state in both services (on the draft once a Propose that names it has answered)."""
        asyncio.ensure_future(self._release(self.target, [r.id]))
        held = proposals.holds(self, r.id)
        if held is not None:                  # named by a Propose not yet answered: released after it
            held.deferred.append(r.id)
        elif self.draft is not None:
            asyncio.ensure_future(self._release(self.draft, [r.id]))

    def fail(self, r: GenRequest, code: grpc.StatusCode, message: str) -> None:
        """End r with an error event (its stream raises it) and free its state in both services."""
        if not r.finished:
            r.events.put_nowait(Event([], "", error=(code, message)))
            self._finish(r, None)

    async def _release(self, stub: TargetStub | DraftStub, ids: list[str]) -> None:
        """Free ids on a service, tried again while it does not answer (a Release lost left a request and its KV
        blocks held there for good); a service restarted meanwhile holds none of them anyway."""
        for wait_s in (*RELEASE_RETRY_S, None):
            try:
                await stub.Release(common_pb2.ReleaseRequest(request_ids=ids), timeout=10)
                return
            except grpc.aio.AioRpcError as e:
                if wait_s is None or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("Release of %s failed: %s", ids, e.code().name)
                    return
            await asyncio.sleep(wait_s)
