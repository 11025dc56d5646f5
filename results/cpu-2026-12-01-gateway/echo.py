"""Round trip of one message on a persistent bidi stream: sync (threaded) server vs grpc.aio server; aio client."""
import asyncio, sys, time, multiprocessing as mp
from concurrent import futures
import grpc

METHOD = "/bench.Echo/Stream"
ident = lambda b: b

def sync_server(port, ready):
    def stream(requests, context):
        for r in requests:
            yield r
    h = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, ident, ident)})
    s = grpc.server(futures.ThreadPoolExecutor(8)); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}"); s.start()
    ready.set(); s.wait_for_termination()

def aio_server(port, ready):
    async def main():
        async def stream(requests, context):
            async for r in requests:
                yield r
        h = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, ident, ident)})
        s = grpc.aio.server(); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}"); await s.start()
        ready.set(); await s.wait_for_termination()
    asyncio.run(main())

def aio_server_rw(port, ready):
    async def main():
        async def stream(request_iterator, context):
            while True:
                r = await context.read()
                if r is grpc.aio.EOF: return
                await context.write(r)
        h = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, ident, ident)})
        s = grpc.aio.server(); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}"); await s.start()
        ready.set(); await s.wait_for_termination()
    asyncio.run(main())

async def client(port, n=2000, size=200):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(METHOD, request_serializer=ident, response_deserializer=ident)()
        msg = b"x" * size
        for _ in range(200):
            await call.write(msg); await call.read()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter(); await call.write(msg); await call.read(); ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts)//2] * 1e6, ts[int(len(ts)*0.9)] * 1e6

if __name__ == "__main__":
    for name, fn, port in (("sync", sync_server, 47001), ("aio", aio_server, 47002), ("aio-rw", aio_server_rw, 47003)):
        ready = mp.Event(); p = mp.Process(target=fn, args=(port, ready), daemon=True); p.start(); ready.wait()
        time.sleep(0.3)
        med, p90 = asyncio.run(client(port))
        print(f"{name:7s} round trip median {med:6.0f} us  p90 {p90:6.0f} us", flush=True)
        p.terminate()
