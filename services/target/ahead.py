"""The next round's Propose, sent to the draft by the target as soon as a Verify has the tokens and rows
(issue 14, a round ahead: VerifyRequest.ahead), so the draft computes while the Verify's answer travels to the
gateway and the gateway plans; the gateway collects the drafts (ProposeRequest.collect_ahead_id).

The Propose goes on the draft's local lane (services/lane.py, frames: infra/lane_wire.py), named by the gateway,
which reaches both services' lanes and so shares their host and network namespace. The target only writes it, as
a PUSH frame, which the draft does not answer (its outcome, a failure too, is kept for the collect): no thread of
the target wakes when the draft is done, just as the Verify's next call is due. A lane that does not connect, or a
write that fails, is reported (VerifyResponse.ahead_sent false) and the gateway sends that Propose itself; a lane
that did not connect is not tried again (a restarted draft announces a new one). Its connection stays open:
closing it with a push not yet read would drop that push (a lane does not run a call whose caller has gone), and
the gateway's collect would wait for it in vain.
"""
from __future__ import annotations

import logging
import socket

from infra import lane_wire as wire
from infra.errors import ServiceError
from tandem.v1 import draft_pb2, target_pb2

log = logging.getLogger("tandem.target")
METHOD = "tandem.v1.DraftService/Propose"
LANE_PREFIX = "tandem-propose-"       # services/lane.py names a draft's lane so
TIMEOUT_S = 2.0            # connecting, the lane's greeting, one write
MAX_LANES = 16             # connections kept open (drafts this target's gateways name)


def check(request: target_pb2.VerifyRequest) -> None:
    """A Verify's `ahead`, before any work: INVALID_ARGUMENT naming the field when it cannot be sent."""
    ahead = request.ahead
    if not (ahead.ahead_id and ahead.draft_lane and ahead.items):
        raise ServiceError("INVALID_ARGUMENT", "ahead: needs ahead_id, draft_lane and items, got "
                           f"ahead_id {ahead.ahead_id!r}, draft_lane {ahead.draft_lane!r}, {len(ahead.items)} items")
    if not ahead.draft_lane.startswith(LANE_PREFIX):      # only a draft's lane is ever connected to
        raise ServiceError("INVALID_ARGUMENT", f"ahead.draft_lane: a draft's local lane ({LANE_PREFIX}...), got "
                           f"{ahead.draft_lane[:80]!r}")
    if not request.return_hidden_rows:
        raise ServiceError("INVALID_ARGUMENT", "ahead: the draft needs the Verify's rows; return_hidden_rows is false")
    if ahead.early and ahead.expect_join:
        raise ServiceError("INVALID_ARGUMENT", "ahead: early and expect_join are both set; a join rides a push sent "
                           "after the acceptance")
    names = {it.request_id for it in request.items}
    seen = set()
    for it in ahead.items:
        if it.request_id not in names or it.request_id in seen:
            raise ServiceError("INVALID_ARGUMENT", f"ahead.items: request {it.request_id!r} is "
                               + ("named twice" if it.request_id in seen else "not an item of this Verify"))
        if it.num_draft_tokens < 1:
            raise ServiceError("INVALID_ARGUMENT", f"ahead.items: request {it.request_id!r} has num_draft_tokens 0, "
                               "expected >= 1 (leave it out instead)")
        seen.add(it.request_id)


class AheadSender:
    """One connection a draft lane, kept open (several gateways of this target may each name another draft: a
    connection closed with a push unread would drop it, as the lane does not run a call whose caller left)."""

    def __init__(self):
        self.socks: dict[str, socket.socket] = {}     # lane -> connection, the most recently used last
        self.unreachable: set[str] = set()            # lanes that did not connect (at most MAX_LANES kept)

    def send(self, ahead: target_pb2.ProposeAhead, emitted: dict[str, list[int]] | None, rows,
             acceptance_tid: int = 0) -> bool:
        """Propose `ahead`'s items with their emitted tokens and the Verify's row set `rows` -> written. emitted
        None: sent before the acceptance reached the host, which is bridge transfer acceptance_tid (ahead.early)."""
        request = draft_pb2.ProposeRequest(
            ahead_id=ahead.ahead_id, expect_join=ahead.expect_join, hidden_rows=[rows], items=[draft_pb2.ProposeItem(
                request_id=it.request_id, new_token_ids=emitted[it.request_id] if emitted else (),
                num_draft_tokens=it.num_draft_tokens, position=it.position, rows_set=1) for it in ahead.items],
            acceptance_transfer_id=acceptance_tid)
        lane = ahead.draft_lane
        sock = self.socks.pop(lane, None)
        if sock is None and (lane in self.unreachable or (sock := self._connect(lane)) is None):
            return False
        try:
            sock.sendall(wire.frame(wire.PUSH, request.SerializeToString()))
        except OSError as e:
            log.warning("the draft's lane %s broke (%s): the gateway sends its Propose itself", lane, e)
            _close(sock)
            return False
        self.socks[lane] = sock
        while len(self.socks) > MAX_LANES:            # drafts gone long ago (a restarted one has a new lane)
            _close(self.socks.pop(next(iter(self.socks))))
        return True

    def _connect(self, name: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(wire.address(name))
            sock.sendall(wire.frame(wire.HELLO, METHOD.encode()))
            head = _recv(sock, wire.HEADER.size)
            n, kind = wire.HEADER.unpack(head) if head else (0, 0)
            if kind != wire.RESPONSE or n:
                raise ConnectionError(f"the lane refused {METHOD}")
        except OSError as e:
            sock.close()
            if len(self.unreachable) >= MAX_LANES:
                self.unreachable.clear()
            self.unreachable.add(name)
            log.warning("the draft's lane %s is not reachable from the target (%s): the gateway sends the next "
                        "round's Propose itself", name, e)
            return None
        log.info("next rounds' Proposes go to the draft's lane %s", name)
        return sock


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """n bytes (None: the peer closed); the socket's timeout bounds each read."""
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf
