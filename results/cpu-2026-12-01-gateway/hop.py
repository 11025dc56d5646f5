import asyncio, subprocess, sys, time, os, statistics
import grpc
sys.path.insert(0, "/work/main")
from tandem.v1 import target_pb2, target_pb2_grpc, rows_pb2, common_pb2
from gateway.lanes import Lane
port = 50911
proc = subprocess.Popen([sys.executable, "-m", "tandem", "target", "--device", "cpu", "--grpc-port", str(port),
                         "--model", "checkpoints/tandem-code-mini", "--hidden-transport", "inline",
                         "--dist-addr", "127.0.0.1:50912", "--bridge-addr", "127.0.0.1:50913"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
async def main():
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = target_pb2_grpc.TargetServiceStub(ch)
    for _ in range(120):
        try:
            await stub.GetInfo(common_pb2.InfoRequest(), timeout=2); break
        except Exception: await asyncio.sleep(0.5)
    await stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(request_id="r", prompt_token_ids=list(range(10, 74)))]), timeout=60)
    lane = Lane(stub.VerifyStream, stub.Verify, "v")
    rows = []
    for i in range(150):
        req = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id="r", draft_token_ids=[5, 6, 7])],
                                       return_hidden_rows=bool(int(sys.argv[1])), transport=rows_pb2.TRANSPORT_INLINE)
        t0 = time.perf_counter(); resp = await lane(req, timeout=30); w = time.perf_counter() - t0
        if i >= 20: rows.append((w, resp.timing.compute_seconds, resp.timing.handler_seconds))
    med = lambda xs: statistics.median(xs) * 1e3
    print(f"rows={sys.argv[1]} wall {med([r[0] for r in rows]):.2f} ms  compute {med([r[1] for r in rows]):.2f}  handler {med([r[2] for r in rows]):.2f}  "
          f"wall-handler {med([r[0]-r[2] for r in rows]):.2f}  handler-compute {med([r[2]-r[1] for r in rows]):.2f}")
try:
    asyncio.run(main())
finally:
    proc.kill()
