import asyncio, sys, time, multiprocessing as mp, statistics, struct
from concurrent import futures
import grpc
METHOD = "/bench.Echo/Stream"
ident = lambda b: b
def busy(ms):
    import torch
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < ms / 1e3:
        a = torch.tanh(a @ a * 0.01)
def sync_server(port, ready, ms):
    import torch
    def stream(requests, context):
        for r in requests:
            t0 = time.perf_counter(); busy(ms); yield struct.pack("d", time.perf_counter() - t0)
    h = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, ident, ident)})
    s = grpc.server(futures.ThreadPoolExecutor(8)); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}"); s.start()
    ready.set(); s.wait_for_termination()
def aio_server(port, ready, ms):
    import torch
    async def main():
        async def stream(requests, context):
            async for r in requests:
                t0 = time.perf_counter(); busy(ms); yield struct.pack("d", time.perf_counter() - t0)
        h = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream, ident, ident)})
        s = grpc.aio.server(); s.add_generic_rpc_handlers((h,)); s.add_insecure_port(f"127.0.0.1:{port}"); await s.start()
        ready.set(); await s.wait_for_termination()
    asyncio.run(main())
async def client(port, n=150):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(METHOD, request_serializer=ident, response_deserializer=ident)()
        over = []
        for i in range(n):
            t0 = time.perf_counter(); await call.write(b"x"); r = await call.read(); w = time.perf_counter() - t0
            if i > 10: over.append(w - struct.unpack("d", r)[0])
        return statistics.median(over) * 1e6
if __name__ == "__main__":
    ms = float(sys.argv[1])
    for name, fn, port in (("sync", sync_server, 47011), ("aio", aio_server, 47012)):
        ready = mp.Event(); p = mp.Process(target=fn, args=(port, ready, ms), daemon=True); p.start(); ready.wait(); time.sleep(0.3)
        print(f"{name:5s} handler {ms:4.0f} ms: wall - handler median {asyncio.run(client(port)):6.0f} us", flush=True)
        p.terminate()
