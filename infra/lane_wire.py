"""The frames of a local lane (issue 14, one cheap hop): a round's Verify or Propose between a gateway and a
service on one host, over a Unix socket instead of gRPC (services/lane.py serves it, gateway/local_lane.py
calls it). No torch here: both sides import it.

A frame is a header (payload bytes: uint32 little-endian, kind: uint8) and the payload:

    HELLO     client -> service, once: the method the client will call, utf-8 ("tandem.v1.TargetService/Verify")
    REQUEST   client -> service: the method's request message (protobuf)
    RESPONSE  service -> client: the response message (protobuf; empty after HELLO)
    ERROR     service -> client: "<grpc.StatusCode name>\\n<details>" (utf-8), instead of a RESPONSE
    PUSH      client -> service: a request nobody answers (the target's Propose pushed a round ahead: its outcome
              waits in the draft for the gateway's collect, services/draft/ahead.py); a failure is logged there

Each REQUEST gets one RESPONSE or ERROR, in order; after an ERROR the connection stays usable, as every
failure is a whole answer. The socket's name is abstract (Linux: no file, gone with the process, reachable
only from the service's network namespace), announced in GetInfo's `local_lane`.
"""
from __future__ import annotations

import select
import socket
import struct

HEADER = struct.Struct("<IB")       # payload bytes, kind
HELLO, REQUEST, RESPONSE, ERROR, PUSH = 1, 2, 3, 4, 5
RDHUP = getattr(select, "POLLRDHUP", 0)    # Linux: the peer shut its side (elsewhere POLLHUP alone tells)


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def error_payload(code_name: str, details: str) -> bytes:
    return f"{code_name}\n{details}".encode("utf-8", "replace")


def parse_error(payload: bytes) -> tuple[str, str]:
    """An ERROR frame's payload -> (status code name, details)."""
    code, _, details = bytes(payload).decode("utf-8", "replace").partition("\n")
    return code, details


def address(name: str) -> str:
    """GetInfo's `local_lane` -> the socket address (abstract namespace: a leading NUL)."""
    return "\0" + name


def peer_closed(sock: socket.socket) -> bool:
    """True once the other end closed its side (data it sent before may still be unread)."""
    p = select.poll()
    p.register(sock, RDHUP)
    return any(ev & (RDHUP | select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))
