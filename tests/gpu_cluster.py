"""`tandem serve --device cuda` as the GPU end-to-end tests start it (tests/test_gpu*.py). A helper."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from cluster import REPO, free_ports, make_checkpoint
from infra.grpc_server import channel_options
from tandem.v1 import draft_pb2_grpc, generate_pb2_grpc, target_pb2_grpc



@contextlib.contextmanager
def serve_cuda(tmp: Path, extra: list[str], device: str = "cuda", model: Path | None = None):
    """`tandem serve --device cuda -k 3` of `model` (default make_checkpoint(seed=5)), fp32, with `extra` flags,
    until SERVING -> (gateway, target, draft stubs, log path); SIGTERM afterwards, which must exit 0."""
    model = model or make_checkpoint(tmp / "ckpt", seed=5)
    gw, tp, dp, bp, dist, http = free_ports(6)
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "tandem", "serve", "--model", str(model), "-k", "3", "--device", device,
           "--dtype", "float32", "--grpc-port", str(gw), "--target-port", str(tp), "--draft-port", str(dp),
           "--bridge-port", str(bp), "--dist-port", str(dist), "--http-port", str(http), "--num-blocks", "1024",
           "--speculation", "fixed", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    chans = []
    try:
        deadline = time.monotonic() + 300
        while b"tandem: serving" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)                   # polling the child's log: it prints one line when all are up
        chans = [grpc.insecure_channel(f"127.0.0.1:{p}", options=channel_options()) for p in (gw, tp, dp)]
        yield (generate_pb2_grpc.GenerateServiceStub(chans[0]), target_pb2_grpc.TargetServiceStub(chans[1]),
               draft_pb2_grpc.DraftServiceStub(chans[2]), log)
    finally:
        for ch in chans:
            ch.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
