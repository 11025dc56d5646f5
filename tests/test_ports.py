"""A port another process serves is refused at start, by name, not shared: gRPC servers set SO_REUSEPORT on Linux
by default, so a second cluster started on a busy port split the first one's clients with it (found probing as an
operator). Flags with values no server can run with are refused by name before anything starts."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from infra.grpc_server import bind, channel_options, server_options


def test_a_busy_grpc_port_is_refused_not_shared():
    first = grpc.server(futures.ThreadPoolExecutor(1), options=server_options())
    port = bind(first, "127.0.0.1", 0, None, "--grpc-port")
    first.start()
    try:
        for options in (server_options(), channel_options() + [("grpc.so_reuseport", 1)]):
            second = grpc.server(futures.ThreadPoolExecutor(1), options=options)
            with pytest.raises(SystemExit) as e:
                bind(second, "127.0.0.1", port, None, "--grpc-port")
            assert f"127.0.0.1:{port}" in str(e.value) and "--grpc-port" in str(e.value)
        shared = [grpc.server(futures.ThreadPoolExecutor(1), options=channel_options()) for _ in range(2)]
        port2 = shared[0].add_insecure_port("127.0.0.1:0")       # what the services did: both bound, clients split
        assert shared[1].add_insecure_port(f"127.0.0.1:{port2}") == port2
    finally:
        first.stop(0)
