"""`tandem target`: the TargetService gRPC server over a TargetEngine."""
from __future__ import annotations

import itertools
import logging
import time

import grpc
import numpy as np
import torch

from services.bridge.channel import RowChannel
from infra.errors import ServiceError
from services.bridge.rows import describe
from services.config import ServiceConfig
from services.launch import run_service
from services.ranks import RankGroup
from services.servicer import STREAM_THREADS, EngineLock, ServicerBase
from services.sampling import Sampling, TopQ
from services.target.synthetic import parse_profile
from services.target import ahead
from services.target.engine import TargetEngine
from infra import grpc_server, tracing
from tandem.v1 import rows_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.target")


def logprob_pb(entry: tuple[float, list[int], list[float]]) -> target_pb2.TokenLogprob:
    lp, ids, lps = entry
    return target_pb2.TokenLogprob(logprob=lp, top_token_ids=ids, top_logprobs=lps)


def _draft_q(it: target_pb2.VerifyItem, V: int):
    """A Verify item's draft distributions, sizes checked -> None, q [k, V] or TopQ [k, w] (values: the engine)."""
    rid, k = it.request_id, len(it.draft_token_ids)
    if it.draft_probs and (it.draft_top_ids or it.draft_top_probs):
        raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: draft_probs and draft_top_ids / draft_top_probs "
                           "both set; give one form of the draft's distributions")
    if it.draft_probs:
        if len(it.draft_probs) != k * V * 4:
            raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: draft_probs has {len(it.draft_probs)} "
                               f"bytes, expected {k} x {V} float32 = {k * V * 4}")
        return torch.from_numpy(np.frombuffer(it.draft_probs, dtype="<f4").copy()).view(k, V)
    if not (it.draft_top_ids or it.draft_top_probs):
        return None
    n_ids, n_probs = len(it.draft_top_ids), len(it.draft_top_probs)
    if n_ids != n_probs or k == 0 or n_ids % (4 * k) or not 1 <= n_ids // (4 * k) <= V:
        raise ServiceError("INVALID_ARGUMENT", f"request {rid!r}: draft_top_ids has {n_ids} bytes and "
                           f"draft_top_probs {n_probs}, expected the same k x w x 4 bytes each with k = {k} "
                           f"drafts and 1 <= w <= vocab {V}")
    shape = (k, n_ids // (4 * k))
    return TopQ(torch.from_numpy(np.frombuffer(it.draft_top_ids, dtype="<i4").astype(np.int64)).view(shape),
                torch.from_numpy(np.frombuffer(it.draft_top_probs, dtype="<f4").copy()).view(shape))


class TargetServicer(ServicerBase, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, cfg: ServiceConfig, group: RankGroup, channel: RowChannel | None):
        self.cfg, self.group, self.engine, self.channel = cfg, group, group.engine, channel
        self.lock = EngineLock(self.release_now)
        self._idle_check_at = 0.0             # next look for requests no call names any more (_release_idle)          # one step at a time: the engine owns the cache
        self._transfer_ids = itertools.count(1)
        self.ahead = ahead.AheadSender()      # next rounds' Proposes, pushed to the draft (ahead.py)
        self.engine.push_rows = self._push_verified
        self.engine.push_acceptance = self._push_acceptance
        self._early: tuple | None = None      # a Verify's early `ahead`: (it, ids, rows a request)
        self._early_sent, self._early_acc = False, 0     # sent with the rows; the acceptance's transfer
        self.early_ok = cfg.early_propose == "on" or cfg.early_propose == "auto" and cfg.device.startswith("cuda")
        profile = parse_profile(cfg.synthetic_acceptance)
        if profile is not None:                 # rank 0 decides acceptance, so only its engine needs it
            self.engine.synthetic_acceptance = profile
            log.warning("BENCHMARK ONLY: --synthetic-acceptance %s: drafts are accepted at random with that "
                        "probability per position, not checked; the output is NOT the model's (greedy requests "
                        "only)", cfg.synthetic_acceptance)

    def _rows(self, want: bool, transport: int, request_ids, rows_per_request, rows) -> rows_pb2.HiddenRows | None:
        desc, push = self._describe(want, transport, request_ids, rows_per_request, rows)
        if push is not None:
            push()
        return desc

    def _describe(self, want: bool, transport: int, request_ids, rows_per_request, rows):
        """-> (the rows' descriptor or None, None or push(): sends them on the bridge)."""
        if not want:
            return None, None
        use_bridge = transport != rows_pb2.TRANSPORT_INLINE and self.channel is not None and self.channel.ready
        if use_bridge and not self.channel.fits(rows):  # over a CUDA IPC slot (--bridge-ipc-mib / 8): inline
            log.warning("hidden rows of %d bytes (%d rows) exceed a CUDA IPC slot of the bridge (%d MiB over 8 "
                        "slots, --bridge-ipc-mib); sending them inline", rows.numel() * rows.element_size(),
                        rows.shape[0], self.cfg.bridge_ipc_mib)
            use_bridge = False
        if not use_bridge:
            return describe(rows, request_ids, rows_per_request, rows_pb2.TRANSPORT_INLINE), None
        tid = next(self._transfer_ids)

        desc = describe(rows, request_ids, rows_per_request, rows_pb2.TRANSPORT_BRIDGE, tid)
        return desc, lambda: self._send(tid, rows)

    def _send(self, tid: int, rows: torch.Tensor) -> None:
        with tracing.span("target.send_rows", rows=int(rows.shape[0]), transfer_id=tid):
            self.channel.send(tid, rows)

    def _push_verified(self, tid: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The engine's push_rows: a Verify's rows [sum(k + 1), D], every verified position's, on the bridge as soon
        as its forward is queued -> the copy sent, or None (the bridge is down, not a ring, or they exceed an IPC
        slot: the committed rows go after the acceptance, as before). Rings only: on one H100 it measured neutral
        (BENCHMARKS.md, thirty-seventh session), and over NCCL it would post the draft's receive a forward before the
        send can run, which no two-GPU run has checked."""
        if not (self.channel is not None and self.channel.ready and self.channel.ring and self.channel.fits(hidden)):
            return None
        rows = hidden.clone()                  # queued behind the forward: hidden may be a CUDA graph's output buffer
        try:                                   # (raising here, inside the engine call, would break a rank group)
            self._send(tid, rows)
        except Exception as e:
            log.warning("hidden rows transfer %d was not pushed (%s: %s): the committed rows go after the Verify",
                        tid, type(e).__name__, e)
            return None
        early, self._early = self._early, None
        if early is not None:                  # the early Propose goes now, naming the acceptance's transfer to come
            ahead_msg, ids, verified = early
            self._early_acc = next(self._transfer_ids)
            desc = describe(rows, ids, verified, rows_pb2.TRANSPORT_BRIDGE, tid)
            self._early_sent = self.ahead.send(ahead_msg, None, desc, self._early_acc)
        return rows

    def _push_acceptance(self, both: torch.Tensor, rows: torch.Tensor) -> None:
        """The engine's push_acceptance: a Verify's acceptance [B, K+2] (accepted | emitted) queued on the device, its
        rows [N, D] pushed (_push_verified). Where its `ahead` is early, the next round's Propose went to the draft
        with the rows, naming this acceptance's transfer, and the acceptance follows them on the ring now, before this
        host reads it (services/draft/early.py): the draft lays its pass out while the target queues its logits and
        acceptance. Pushed late (the bridge failing between the two sends), the draft's take of it waits out the
        ring's wait and answers NOT_FOUND: its requests lose this round's drafts and are re-synced."""
        acc, self._early_acc = self._early_acc, 0
        if not (acc and self._early_sent):
            return
        try:
            self._send(acc, both)
        except Exception as e:
            log.warning("the acceptance (transfer %d) was not pushed (%s: %s): the draft's early pass answers "
                        "NOT_FOUND", acc, type(e).__name__, e)

    def _guard(self, context, fn):
        try:
            with self.lock:
                grpc_server.time_left(context)       # expired while waiting for the lock: do nothing
                self._release_idle()
                return fn()
        except ServiceError as e:
            grpc_server.abort(context, e.code, str(e))

    def _release_idle(self) -> None:
        """Release what no call named for --request-idle-s (looked at every quarter of it, at most every minute): the
        requests of a gateway that crashed, or whose Release was lost, held their KV blocks for good."""
        now, idle_s = time.monotonic(), self.cfg.request_idle_s
        if idle_s <= 0 or now < self._idle_check_at:
            return
        self._idle_check_at = now + min(60.0, idle_s / 4)
        if ids := self.engine.idle(idle_s):
            log.warning("releasing %d requests no call named for %.0f s (their gateway is gone?): %s", len(ids),
                        idle_s, ids[:4])
            self.release_now(ids)

    def _limits(self, it, drafts: int = 0) -> None:
        """Per item, before any work: the configured caps on top-n logprobs and drafts per request."""
        if it.HasField("logprobs") and it.logprobs > self.cfg.max_logprobs:
            raise ServiceError("INVALID_ARGUMENT", f"request {it.request_id!r}: logprobs is {it.logprobs}, this "
                               f"target returns at most {self.cfg.max_logprobs} alternatives (--max-logprobs)")
        if drafts > self.cfg.max_draft_tokens:
            raise ServiceError("INVALID_ARGUMENT", f"request {it.request_id!r}: {drafts} draft tokens, this target "
                               f"verifies at most {self.cfg.max_draft_tokens} per request (--max-draft-tokens)")

    def _prefill_args(self, request: target_pb2.PrefillRequest) -> tuple:
        """A Prefill's items, checked against the limits -> the engine's (items, logprobs or None, budgets)."""
        for it in request.items:
            self._limits(it)
        items = [(it.request_id, list(it.prompt_token_ids), Sampling.from_pb(it.request_id, it.sampling))
                 for it in request.items]
        if not items:
            raise ServiceError("INVALID_ARGUMENT", "items is empty")
        want = [(it.logprobs if it.HasField("logprobs") else None, it.prompt_logprobs) for it in request.items]
        return items, want if any(n is not None or p for n, p in want) else None, [it.max_chunk_tokens for it in request.items]

    def _prefill_response(self, request: target_pb2.PrefillRequest, items: list, res) -> target_pb2.PrefillResponse:
        rows = self._rows(request.return_hidden_rows, request.transport, [i[0] for i in items],
                          [e - c for c, e in zip(res.cached, res.computed)], res.hidden)
        resp = target_pb2.PrefillResponse(first_token_ids=res.first, hidden_rows=rows,
                                          num_cached_tokens=res.cached, num_computed_tokens=res.computed)
        for e in res.logprobs or []:
            resp.logprobs.add(prompt=[logprob_pb(x) for x in e["prompt"]],
                              first_token=logprob_pb(e["first"]) if e["first"] else None)
        return resp

    def Prefill(self, request, context):
        def run():
            items, want, budgets = self._prefill_args(request)
            with tracing.span("target.prefill", requests=len(items), tokens=sum(len(i[1]) for i in items)):
                res = self.group.call(TargetEngine.prefill, items, want, budgets)
            return self._prefill_response(request, items, res)
        return self._guard(context, run)

    def Verify(self, request, context):
        def run():
            V = self.engine.vocab_size
            items = []
            for it in request.items:
                self._limits(it, len(it.draft_token_ids))
                items.append((it.request_id, list(it.draft_token_ids), _draft_q(it, V)))
            if not items:
                raise ServiceError("INVALID_ARGUMENT", "items is empty")
            if request.HasField("ahead"):
                ahead.check(request)
            want = [it.logprobs if it.HasField("logprobs") else None for it in request.items]
            want = want if any(n is not None for n in want) else None
            riding, pre, refused = request.HasField("prefill"), None, None
            if riding:                                      # a bad prefill item refuses the prefill, not the round
                try:
                    pitems, pwant, budgets = self._prefill_args(request.prefill)
                except ServiceError as e:
                    riding, pre = False, e
            # every verified row on the bridge before the acceptance's sync (the engine's push_rows)
            early = next(self._transfer_ids) if request.return_hidden_rows and request.transport != \
                rows_pb2.TRANSPORT_INLINE and self.channel is not None else 0
            self._early_sent, self._early_acc = False, 0
            self._early = (request.ahead, [i[0] for i in items], [len(i[1]) + 1 for i in items]) \
                if early and request.ahead.early and self.early_ok else None
            t0 = time.perf_counter()
            with tracing.span("target.verify", requests=len(items), draft_tokens=sum(len(i[1]) for i in items),
                              prefill_requests=len(request.prefill.items)) as span:
                if riding:
                    res, pre = self.group.call(TargetEngine.verify_and_prefill, items, want, pitems, pwant, budgets,
                                               early)
                else:
                    res = self.group.call(TargetEngine.verify, items, want, early)
                if span is not None:
                    span.set_attribute("accepted_tokens", sum(res.accepted))
            compute_s = time.perf_counter() - t0
            if isinstance(pre, ServiceError):
                pre, refused = None, target_pb2.CallStatus(code=grpc.StatusCode[pre.code].value[0], message=str(pre))
            ids, used = [i[0] for i in items], [a + 1 for a in res.accepted]
            if res.pushed:                              # the rows of every verified token, the committed ones used
                desc, push = describe(res.rows, ids, [len(i[1]) + 1 for i in items], rows_pb2.TRANSPORT_BRIDGE,
                                      early, used), None
            else:
                desc, push = self._describe(request.return_hidden_rows, request.transport, ids, used, res.rows)
            if push is not None and not (request.HasField("ahead") and self.channel.pushes):
                push()                                  # parked before the draft can ask (a pull must find them)
                push = None
            sent = self._early_sent or request.HasField("ahead") and self.ahead.send(   # the next Propose, now
                request.ahead, {i[0]: t for i, t in zip(items, res.emitted)}, desc)
            self._early = None
            if push is not None:                        # into their ring slot while the draft reads its Propose
                push()
            results = [target_pb2.VerifyResult(num_accepted=a, emitted_token_ids=t,
                                               logprobs=[logprob_pb(x) for x in lp])
                       for a, t, lp in zip(res.accepted, res.emitted, res.logprobs or [[] for _ in items])]
            return target_pb2.VerifyResponse(
                results=results, hidden_rows=desc, ahead_sent=sent, ahead_early=self._early_sent, prefill_status=refused,
                prefill=self._prefill_response(request.prefill, pitems, pre) if pre is not None else None,
                timing=rows_pb2.CallTiming(compute_seconds=compute_s, handler_seconds=time.perf_counter() - t0))
        return self._guard(context, run)

    def VerifyStream(self, requests, context):
        return self._stream(requests, context)

    def lane(self):
        return "tandem.v1.TargetService/Verify", target_pb2.VerifyRequest, self.Verify

    def RecomputeRows(self, request, context):
        def run():
            items = [(it.request_id, list(it.token_ids)) for it in request.items]
            if not items:
                raise ServiceError("INVALID_ARGUMENT", "items is empty")
            with tracing.span("target.recompute_rows", requests=len(items), tokens=sum(len(t) for _, t in items)):
                rows = self.group.call(TargetEngine.recompute_rows, items)
            return target_pb2.RecomputeRowsResponse(hidden_rows=self._rows(
                True, request.transport, [rid for rid, _ in items], [len(t) - 1 for _, t in items], rows))
        return self._guard(context, run)

    def running(self) -> int:
        return len(self.engine.requests)


TargetServicer.VerifyStream.experimental_thread_pool = STREAM_THREADS


def main(argv=None) -> int:
    from models.model import TargetModel
    return run_service("target", list(argv or []), __doc__, TargetModel, TargetEngine, TargetServicer,
                       target_pb2_grpc.add_TargetServiceServicer_to_server, "tandem.v1.TargetService")
