"""The served round without the wire: the gateway's own Scheduler (gateway/scheduler.py) over the target and
draft servicers of this process (services/*/server.py) through stubs that call them directly.

Same engines, kernels, servicers, contract checks and round code as the served cluster; what is left out is
gRPC (no channel, no serialization of calls: messages are handed over as objects), the gateway process and
the bridge (hidden rows pass as tensors, moved to the draft's device). So served / in-process tokens/s is
the cost of the split itself. A failure inside a servicer reaches the scheduler as the grpc.aio.AioRpcError
a stub would raise, with the status the service would send (gateway/stubs.py).
"""
from __future__ import annotations

import asyncio
import threading

import grpc

from infra.defaults import MAX_DRAFT_TOKENS
from services.bridge.rows import check_finite
from services.config import ServiceConfig
from services.draft.server import DraftServicer
from services.ranks import RankGroup
from services.target.server import TargetServicer
from tandem.v1 import rows_pb2


class _Context:
    """What a servicer reads of its gRPC context: no deadline; abort raises what the client would see."""

    def time_remaining(self):
        return None

    def abort(self, code: grpc.StatusCode, details: str):
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class TensorChannel:
    """The bridge in one process: the target parks each transfer's rows, the draft takes them (on its device)."""
    ready = True
    pushes = False                                  # parked: sent before the Propose that names them
    ring = False                                    # a Verify's rows are parked after its acceptance, as before

    def __init__(self, draft_device):
        self.device, self.rows, self.lock = draft_device, {}, threading.Lock()

    def fits(self, rows) -> bool:
        return True

    def send(self, transfer_id: int, rows) -> None:
        with self.lock:
            self.rows[transfer_id] = rows.to(self.device, non_blocking=True)

    def take(self, transfer_id: int, timeout_s: float, field: str | None = None):
        with self.lock:
            rows = self.rows.pop(transfer_id)
        if field:                                   # checked finite, as RowChannel.take does
            check_finite(rows, field)
        return rows

    def take_later(self, transfer_id: int, timeout_s: float, field: str):
        return self.take(transfer_id, timeout_s, field), None

    def discard(self, transfer_id: int) -> None:
        with self.lock:
            self.rows.pop(transfer_id, None)


class Stub:
    """A servicer's methods as the scheduler awaits them (gateway/stubs.py's TargetStub / DraftStub)."""

    def __init__(self, servicer):
        self._servicer = servicer

    def __getattr__(self, method: str):
        handler = getattr(self._servicer, method)

        async def call(request, timeout: float | None = None, **_):
            return handler(request, _Context())
        call.inline = True          # computes when awaited, blocking the loop (gateway/proposals.py)
        return call


def servicer_stubs(te, de) -> tuple[Stub, Stub | None]:
    """In-process stubs of the target and draft servicers over these engines (tp 1, rows as tensors)."""
    channel = TensorChannel(de.cache.device) if de is not None else None

    def cfg(role, engine):
        return ServiceConfig(role=role, model="in-process", device=str(engine.cache.device),
                             max_draft_tokens=MAX_DRAFT_TOKENS)
    target = Stub(TargetServicer(cfg("target", te), RankGroup(te, te.model.ps), channel))
    draft = Stub(DraftServicer(cfg("draft", de), RankGroup(de, de.model.ps), channel)) if de is not None else None
    return target, draft


async def generate_all(target, draft, prompts: list[list[int]], k: int, batch: int, max_tokens: int,
                       observer=None, seeds: list[int] | None = None) -> tuple[list, list]:
    """Greedy decoding of every prompt through the Scheduler, `batch` at a time (continuous batching),
    K drafts per round -> (the finished GenRequests in prompt order, their events). seeds: each request's
    (greedy output ignores it; --synthetic-acceptance draws from it), else unseeded."""
    from gateway.request import GenRequest
    from gateway.scheduler import Scheduler
    from gateway.text import TextStream

    class Ids:                               # no tokenizer: the text side is not measured
        def decode(self, ids):
            return ""
    sched = Scheduler(target, draft, set(), max_batch=batch, transport=rows_pb2.TRANSPORT_BRIDGE,
                      observer=observer)
    loop = asyncio.ensure_future(sched.run())
    reqs = [GenRequest(id=sched.new_id(), prompt_ids=list(p), max_tokens=max_tokens,
                       sampling=rows_pb2.SamplingParams(seed=seeds[i]) if seeds else rows_pb2.SamplingParams(),
                       text=TextStream(Ids(), []), ignore_eos=True, k=k)
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    events = []
    try:
        for r in reqs:
            got = []
            while not got or got[-1].finish_reason is None and got[-1].error is None:
                got.append(await r.events.get())
            events.append(got)
        while sched.running or sched.waiting or sched.prefilling:           # the last Release calls run as tasks
            await asyncio.sleep(0)
        await asyncio.sleep(0)
    finally:
        loop.cancel()
    return reqs, events
