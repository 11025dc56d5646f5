"""A service handler's unexpected exception (a CUDA out-of-memory, a bug) reaches the caller as INTERNAL naming
the method and the error, on unary calls and on streams; a handler's own abort keeps its status. A real gRPC
server with the services' interceptor, a real channel."""
import logging
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from infra.grpc_server import InternalErrors


def _echo(request: bytes, context):
    if request == b"boom":
        raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
    if request == b"bad":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items is empty")
    return request


ENDED = threading.Event()          # set when a stream handler returns (or raises)
WAITING = threading.Event()        # set while a stream handler waits for its next request
RAISED: list = []                  # what a stream handler ended with, if it raised


def _stream(requests, context):
    try:
        WAITING.set()
        for r in requests:
            WAITING.clear()
            yield _echo(r, context)
            WAITING.set()
    except BaseException as e:
        RAISED.append(e)
        raise
    finally:
        ENDED.set()


@pytest.fixture
def channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[InternalErrors()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Svc", {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "EchoStream": grpc.stream_stream_rpc_method_handler(_stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    server.stop(None)


def test_unary_exception_is_internal(channel):
    call = channel.unary_unary("/t.Svc/Echo")
    assert call(b"hi", timeout=10) == b"hi"
    with pytest.raises(grpc.RpcError) as e:
        call(b"boom", timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "t.Svc/Echo" in e.value.details() and "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        call(b"bad", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "items is empty"


def test_stream_exception_is_internal(channel):
    call = channel.stream_stream("/t.Svc/EchoStream")
    replies = call(iter([b"a", b"b", b"boom", b"c"]), timeout=10)
    assert next(replies) == b"a" and next(replies) == b"b"
    with pytest.raises(grpc.RpcError) as e:
        next(replies)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "t.Svc/EchoStream" in e.value.details()
    replies = call(iter([b"a", b"bad"]), timeout=10)
    assert next(replies) == b"a"
    with pytest.raises(grpc.RpcError) as e:
        next(replies)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_cancel_is_not_an_internal_error(channel, caplog):
    """A client that cancels its stream (a gateway shutting down) makes the handler's request iterator raise
    grpc.RpcError: that is the client's doing, not the service's, so nothing is logged as a failure."""
    call = channel.stream_stream("/t.Svc/EchoStream")
    sent: queue.Queue = queue.Queue()
    replies = call(iter(sent.get, None), timeout=10)
    sent.put(b"a")
    assert next(replies) == b"a"
    ENDED.clear()
    RAISED.clear()
    # cancel while the handler waits on its request iterator: the iterator then raises grpc.RpcError, or (as gRPC
    # sees the cancellation first or not) simply ends, and the handler returns with nothing to log
    assert WAITING.wait(10)
    with caplog.at_level(logging.DEBUG, logger="tandem.grpc"):
        replies.cancel()
        assert ENDED.wait(10)
        deadline = time.monotonic() + 10       # the interceptor logs after the handler's finally
        while RAISED and not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    if RAISED:                                 # it raised: the interceptor says the client went away, no more
        assert isinstance(RAISED[0], grpc.RpcError), RAISED
        assert any("client went away" in r.getMessage() for r in caplog.records), caplog.text
    sent.put(None)
