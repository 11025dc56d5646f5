"""The seam between the gateway's scheduler and the services: all the Scheduler (gateway/scheduler.py)
and the re-sync (gateway/resync.py) use of the target and the draft is the methods below, so they take
any objects that have them, not only gRPC stubs.

The gateway passes grpc.aio stubs (tandem.v1 TargetServiceStub, DraftServiceStub): their methods
return awaitable calls. Objects with `async def` methods of the same names serve as well, e.g. ones
that call the target and draft servicers in process (no channel, no serialization). Such an object
must, like a stub:

- take the request message and `timeout=` (seconds; the call may ignore it) and return the response
  message of tandem/v1 (target.proto, draft.proto);
- report a failure by raising grpc.aio.AioRpcError with the status code the service would send,
  since the scheduler's fault rules read it: CONTRACT_CODES fail the requests of the call, a failed
  Propose only degrades speculation, a failed Prefill / Verify fails its requests, UNAVAILABLE from
  the target refuses new requests (gateway/availability.py).

tests/test_scheduler_faults.py drives the Scheduler over such objects (fakes). GetInfo and health are
not part of this seam: gateway/watch.py and gateway/metrics.py poll the real services over their
channels.
"""
from __future__ import annotations

from typing import Awaitable, Protocol

import grpc

from tandem.v1 import common_pb2, draft_pb2, target_pb2

# a service's answer that the gateway broke the contract (its committed tokens or rows disagree with the
# service's): the requests fail with it, where any other failure of the draft only costs speed
CONTRACT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
ROW_CONTRACT = "hidden rows contract"       # how the services' row checks begin their message (services/bridge/rows.py)
CORE_BROKEN = "Internal error from Core"     # gRPC core's own INTERNAL, no service's: the call broke in transport


def client_status(e: grpc.aio.AioRpcError) -> grpc.StatusCode:
    """A service's failure as the client's status: a hidden-row contract broken between target and draft is a
    fault inside the cluster (INTERNAL, REST 500), never the client's; a call that broke in gRPC's transport
    (CORE_BROKEN: the service died while it answered) is the service gone (UNAVAILABLE); every other code passes
    through."""
    details = e.details() or ""
    if ROW_CONTRACT in details:
        return grpc.StatusCode.INTERNAL
    if e.code() == grpc.StatusCode.INTERNAL and details.startswith(CORE_BROKEN):
        return grpc.StatusCode.UNAVAILABLE
    return e.code()


class TargetStub(Protocol):
    """The target as the scheduler calls it: Prefill new requests, Verify each round's drafts,
    RecomputeRows for a re-sync, Release finished requests."""

    def Prefill(self, request: target_pb2.PrefillRequest, *,
                timeout: float | None = None) -> Awaitable[target_pb2.PrefillResponse]: ...

    def Verify(self, request: target_pb2.VerifyRequest, *,
               timeout: float | None = None) -> Awaitable[target_pb2.VerifyResponse]: ...

    def RecomputeRows(self, request: target_pb2.RecomputeRowsRequest, *,
                      timeout: float | None = None) -> Awaitable[target_pb2.RecomputeRowsResponse]: ...

    def Release(self, request: common_pb2.ReleaseRequest, *,
                timeout: float | None = None) -> Awaitable[common_pb2.ReleaseResponse]: ...


class DraftStub(Protocol):
    """The draft as the scheduler calls it: Propose each round, Release finished (or re-synced) requests."""

    def Propose(self, request: draft_pb2.ProposeRequest, *,
                timeout: float | None = None) -> Awaitable[draft_pb2.ProposeResponse]: ...

    def Release(self, request: common_pb2.ReleaseRequest, *,
                timeout: float | None = None) -> Awaitable[common_pb2.ReleaseResponse]: ...
