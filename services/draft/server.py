"""`tandem draft`: the DraftService gRPC server over a DraftEngine (the MTP proposer)."""
from __future__ import annotations

import logging
import time

import torch

from services.bridge.channel import RowChannel
from infra.errors import ServiceError
from services.bridge.rows import check, check_finite, check_payload, decode_inline, rows_by_request
from services.config import ServiceConfig
from services.launch import run_service
from services.ranks import RankGroup
from services.servicer import STREAM_THREADS, EngineLock, ServicerBase
from services.sessions import Sessions
from services.draft.ahead import AheadStore, Joins
from services.draft import early
from services.draft.engine import DraftEngine, ProposeItem
from services.sampling import Sampling, TopQ
from infra import grpc_server, tracing
from infra.grpc_server import internal_details
from tandem.v1 import draft_pb2, draft_pb2_grpc, rows_pb2

log = logging.getLogger("tandem.draft")
AHEAD_WAIT_S = 60.0        # a collect without a deadline (a local lane's) waits this long for the push's answer


class DraftServicer(ServicerBase, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, cfg: ServiceConfig, group: RankGroup, channel: RowChannel | None):
        self.cfg, self.group, self.engine, self.channel = cfg, group, group.engine, channel
        self.lock = EngineLock(self.release_now)
        self.ahead = AheadStore()                 # Proposes the target pushed a round ahead (ahead.py)
        self.joins = Joins()                      # ... and the joining requests' Proposes riding them
        self.sessions = Sessions(cfg.request_idle_s)   # the gateways that hold requests here (services/sessions.py)
        self.hidden_size = group.engine.model.cfg.hidden_size

    def _item(self, it) -> ProposeItem:
        # (a Propose pushed a round ahead names no sampling: its requests run, the draft holds theirs)
        sampling = Sampling.from_pb(it.request_id, it.sampling) if it.HasField("sampling") else Sampling()
        if it.num_draft_tokens > self.cfg.max_draft_tokens:
            raise ServiceError("INVALID_ARGUMENT", f"request {it.request_id!r}: num_draft_tokens is "
                               f"{it.num_draft_tokens}, this draft proposes at most {self.cfg.max_draft_tokens} "
                               "(--max-draft-tokens)")
        return ProposeItem(it.request_id, list(it.new_token_ids), it.num_draft_tokens, sampling, it.position,
                           it.cached_tokens)

    def _gather_rows(self, request, expected: dict[str, int]) -> tuple[dict[str, torch.Tensor], list]:
        """Check every row set against `expected` before touching it; -> (request id -> rows [n, D], the bridge
        takes' landed() checks: RowChannel.take_later, to run once the Propose's compute is done)."""
        out: dict[str, torch.Tensor] = {}
        landed = []
        dtype = self.engine.model.lm_head.weight.dtype
        where = {it.request_id: it.rows_set for it in request.items}     # 1-based; 0: the set naming it
        for rid, n in where.items():
            if n > len(request.hidden_rows):
                raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: rows_set is {n}, the call has "
                                   f"{len(request.hidden_rows)} hidden row sets")
        for i, desc in enumerate(request.hidden_rows):
            mine = {r: expected[r] for r in desc.request_ids if r in expected and where[r] in (0, i + 1)}
            try:
                check(desc, mine, self.hidden_size, dtype)
                if desc.layout != rows_pb2.ROW_LAYOUT_FULL:
                    raise ServiceError("INVALID_ARGUMENT", "hidden rows contract: the draft takes FULL rows; "
                                       f"got layout {rows_pb2.RowLayout.Name(desc.layout)}")
                if desc.transport == rows_pb2.TRANSPORT_INLINE:
                    rows = decode_inline(desc, self.cfg.device)
                    check_finite(rows, f"hidden_rows[{i}].inline_data")
                else:
                    if self.channel is None:
                        raise ServiceError("FAILED_PRECONDITION", "rows sent on the bridge, but this draft "
                                           "runs with --hidden-transport inline")
                    rows, taken = self.channel.take_later(desc.transfer_id, self.cfg.bridge_timeout_s,
                                                          f"hidden_rows[{i}] (bridge transfer {desc.transfer_id})")
                    if taken is not None:             # (the CUDA IPC ring: checked after the compute)
                        landed.append(taken)
                    check_payload(desc, rows)
            except TimeoutError as e:
                raise ServiceError("UNAVAILABLE", str(e)) from None
            except LookupError as e:         # no such transfer parked on the target
                raise ServiceError("NOT_FOUND", str(e)) from None
            except ServiceError:
                if desc.transport == rows_pb2.TRANSPORT_BRIDGE and self.channel is not None:
                    self.channel.discard(desc.transfer_id)
                raise
            for rid, r in rows_by_request(desc, rows).items():
                if rid in mine:
                    if rid in out:
                        raise ServiceError("INVALID_ARGUMENT", f"request {rid!r} appears in two hidden row sets")
                    out[rid] = r
        missing = [r for r in expected if r not in out]
        if missing:
            raise ServiceError("INVALID_ARGUMENT", f"hidden rows contract: request {missing[0]!r} needs "
                               f"{expected[missing[0]]} rows and no hidden row set names it")
        return out, landed

    def Propose(self, request, context):
        self.sessions.saw(request.gateway_session)      # (a collect computes nothing, yet its gateway is alive)
        try:
            if request.ride_ahead_id and (request.ahead_id or request.collect_ahead_id):
                raise ServiceError("INVALID_ARGUMENT", "ride_ahead_id: a Propose riding a push is the gateway's own, "
                                   f"got ahead_id {request.ahead_id!r} and collect_ahead_id "
                                   f"{request.collect_ahead_id!r} with it")
            if request.collect_ahead_id:          # the gateway: what the target's push came to (ahead.py)
                got = self.ahead.collect(request.collect_ahead_id, grpc_server.time_left(context) or AHEAD_WAIT_S)
                if isinstance(got, ServiceError):
                    raise got
                return got
            if request.ride_ahead_id:             # the gateway: joining requests, computed in the push's pass
                join = self._ride(request, context)
                if join is not None:
                    return join
            if request.ahead_id:                  # the target: computed now, answered at once, kept for the collect
                self.ahead.pushed(request.ahead_id)
                join = self.joins.meet(request.ahead_id) if request.expect_join else None
                try:
                    self.ahead.done(request.ahead_id, self._pass(request, join, context))
                except ServiceError as e:
                    self.ahead.done(request.ahead_id, e)
                except Exception as e:            # a bug: the collect answers INTERNAL, not a wait
                    self.ahead.done(request.ahead_id, ServiceError("INTERNAL", internal_details(
                        "tandem.v1.DraftService/Propose (pushed ahead)", e)))
                    raise
                return draft_pb2.ProposeResponse()
            return self._propose(request, context)
        except ServiceError as e:
            grpc_server.abort(context, e.code, str(e))

    def _ride(self, request, context) -> draft_pb2.ProposeResponse | None:
        """A join (ride_ahead_id): its push's pass's answer, or None when they did not meet (computed alone)."""
        join = self.joins.ride(request.ride_ahead_id, request)
        if join is None:
            return None
        if not join.answered.wait(grpc_server.time_left(context) or AHEAD_WAIT_S):
            raise ServiceError("DEADLINE_EXCEEDED", f"the Propose pushed ahead as {request.ride_ahead_id!r}, which "
                               "this one rides, did not finish in time")
        if isinstance(join.outcome, ServiceError):
            raise join.outcome
        return join.outcome

    def _pass(self, push, join, context) -> draft_pb2.ProposeResponse:
        """A push's Propose and the join riding it (None: alone) in one pass; the join is answered here, with the
        pass's status if it fails. The join's rows sets follow the push's in the call."""
        if join is None:
            return self._propose(push, context)
        n, sets = len(push.items), len(push.hidden_rows)
        both = draft_pb2.ProposeRequest(items=push.items, gateway_session=join.request.gateway_session,
                                        hidden_rows=list(push.hidden_rows) + list(join.request.hidden_rows))
        for it in join.request.items:
            both.items.add().CopyFrom(it)
            if it.rows_set:
                both.items[-1].rows_set = it.rows_set + sets
        try:
            resp = self._propose(both, context)
            join.outcome = draft_pb2.ProposeResponse(results=resp.results[n:], timing=resp.timing,
                                                     computed_with_ahead_id=push.ahead_id)
        except ServiceError as e:
            join.outcome = e
            raise
        except Exception as e:
            join.outcome = ServiceError("INTERNAL", internal_details("tandem.v1.DraftService/Propose (riding)", e))
            raise
        finally:
            join.answered.set()
        return draft_pb2.ProposeResponse(results=resp.results[:n], transfer_seconds=resp.transfer_seconds,
                                         timing=resp.timing)

    def _propose(self, request, context) -> draft_pb2.ProposeResponse:
        with self.lock:
            # expired while waiting for the lock: do nothing. (A bridge pull, once asked for,
            # is never cut short by the deadline: a pull given up leaves the channel out of step.)
            grpc_server.time_left(context)
            if gone := self.sessions.gone(self.engine.committed):
                log.warning("releasing %d requests of gateway sessions silent for %.0f s (their gateway is gone?): "
                            "%s", len(gone), self.sessions.idle_s, gone[:4])
                self.release_now(gone)
            items = [self._item(it) for it in request.items]
            self.sessions.saw(request.gateway_session, [it.request_id for it in items])
            if request.acceptance_transfer_id:
                return self._early(request, items)
            expected = self.engine.expected_rows(items)
            t0 = time.perf_counter()
            with tracing.span("draft.transfer", rows=sum(expected.values())):
                rows, landed = self._gather_rows(request, expected)
            transfer_s = time.perf_counter() - t0
            with tracing.span("draft.propose", requests=len(items)):
                # rows taken without a wait (CUDA IPC: read in place by the compute): their checks once it is done,
                # then the round's blocks go to the prefix cache
                results = self.group.call(DraftEngine.propose, items, rows, not landed)
                if landed:
                    _landed(landed)
                    self.group.call(DraftEngine.seal)
                not_held = [it.request_id in self.engine.not_held for it in items]
            done = time.perf_counter()
        return draft_pb2.ProposeResponse(results=[_result(d, q, n) for (d, q), n in zip(results, not_held)],
            transfer_seconds=transfer_s, timing=rows_pb2.CallTiming(
                transfer_seconds=transfer_s, compute_seconds=done - t0 - transfer_s, handler_seconds=done - t0))

    def _early(self, request, items: list[ProposeItem]) -> draft_pb2.ProposeResponse:
        """A push sent before the target read its acceptance (services/draft/early.py): one rows set on the bridge
        with every verified row, and the acceptance frame beside it."""
        desc = request.hidden_rows[0] if len(request.hidden_rows) == 1 else None
        if desc is None or desc.transport != rows_pb2.TRANSPORT_BRIDGE or desc.layout != rows_pb2.ROW_LAYOUT_FULL \
                or desc.used_rows_per_request or self.channel is None or any(it.rows_set > 1 for it in request.items):
            raise ServiceError("INVALID_ARGUMENT", "acceptance_transfer_id: an early Propose has one rows set, on "
                               f"the bridge, every verified row; got {len(request.hidden_rows)} sets"
                               + ("" if self.channel else " (this draft runs with --hidden-transport inline)"))
        check(desc, {}, self.hidden_size, self.engine.model.lm_head.weight.dtype)
        at = {rid: i for i, rid in enumerate(desc.request_ids)}
        verified = [desc.rows_per_request[at[it.request_id]] if it.request_id in at else 0 for it in items]
        early.check_items(self.engine, items, verified, self.cfg.max_draft_tokens)
        ids, tid = [it.request_id for it in items], desc.transfer_id
        # the step laid out while the target still computes (before the takes: nothing of it waits behind the rows)
        self.group.call(DraftEngine.lay_out_early, items, verified, [at[r] for r in ids])
        t0 = time.perf_counter()
        try:
            rows, rows_landed = self.channel.take_later(tid, self.cfg.bridge_timeout_s,
                                                        f"hidden_rows[0] (bridge transfer {tid})")
            check_payload(desc, rows)
            frame, frame_landed = self.channel.take_later(request.acceptance_transfer_id, self.cfg.bridge_timeout_s, "")
        except TimeoutError as e:
            raise ServiceError("UNAVAILABLE", str(e)) from None
        except LookupError as e:
            raise ServiceError("NOT_FOUND", str(e)) from None
        if ids != list(desc.request_ids):                       # a subset, or another order: the items' rows
            per = rows_by_request(desc, rows)
            rows = torch.cat([per[r] for r in ids])
        landed = [c for c in (rows_landed, frame_landed) if c is not None]
        transfer_s = time.perf_counter() - t0
        with tracing.span("draft.propose", requests=len(items), early=True):
            results = self.group.call(DraftEngine.propose_early, items, rows, verified, frame,
                                      [at[r] for r in ids], not landed)
            if landed:
                _landed(landed)
                self.group.call(DraftEngine.seal)
        done = time.perf_counter()          # compute: from the acceptance's landing (before it, the step waited on
        return draft_pb2.ProposeResponse(  # the target's forward, off the round's critical path)
            results=[_result(d, q, False) for d, q in results], transfer_seconds=transfer_s,
            timing=rows_pb2.CallTiming(transfer_seconds=transfer_s, compute_seconds=done - self.engine.landed_at,
                                       handler_seconds=done - t0))

    def ProposeStream(self, requests, context):
        return self._stream(requests, context)

    def lane(self):
        return "tandem.v1.DraftService/Propose", draft_pb2.ProposeRequest, self.Propose

    def lane_spins_after(self, request) -> bool:
        """Only after a Propose the gateway sent itself. Not after a collect: the gateway's next one waits for a
        push anyway. Not after a push: the next is a round away, and a reader spinning meanwhile takes the GIL back
        after every poll, so the thread that answers the collect (woken as the push's drafts are done) waited out
        the switch interval (0.2 ms) for it, on the round's critical path."""
        return not (request.collect_ahead_id or request.ahead_id)

    def running(self) -> int:
        return len(self.engine.committed)

    def GetInfo(self, request, context):
        self.sessions.saw(request.gateway_session)       # a gateway's keepalive (gateway/watch.py)
        return super().GetInfo(request, context)


def _landed(checks: list) -> None:
    """The rows' bridge checks, after the compute that used them: a frame overwritten before or during that use is
    NOT_FOUND (the gateway re-syncs these requests: what they computed is dropped), non-finite rows the
    contract's INVALID_ARGUMENT; the round's blocks were not given to the prefix cache."""
    try:
        for check in checks:
            check()
    except LookupError as e:
        raise ServiceError("NOT_FOUND", str(e)) from None


def _result(drafts: list[int], q, not_held: bool) -> draft_pb2.ProposeResult:
    """One item's ProposeResult: q None (greedy), TopQ (sparse) or [k, V] (--draft-q-mass 1)."""
    if q is None:
        return draft_pb2.ProposeResult(draft_token_ids=drafts, not_held=not_held)
    if isinstance(q, TopQ):
        return draft_pb2.ProposeResult(draft_token_ids=drafts, not_held=not_held,
                                       draft_top_ids=q.ids.numpy().astype("<i4").tobytes(),
                                       draft_top_probs=q.probs.float().numpy().astype("<f4").tobytes())
    return draft_pb2.ProposeResult(draft_token_ids=drafts, not_held=not_held,
                                   draft_probs=q.float().numpy().astype("<f4").tobytes())


DraftServicer.ProposeStream.experimental_thread_pool = STREAM_THREADS


def main(argv=None) -> int:
    from models.model import DraftModel
    return run_service("draft", list(argv or []), __doc__, DraftModel, DraftEngine, DraftServicer,
                       draft_pb2_grpc.add_DraftServiceServicer_to_server, "tandem.v1.DraftService")
