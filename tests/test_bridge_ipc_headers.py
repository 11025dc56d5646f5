"""The CUDA IPC ring's host headers (services/bridge/ipc.py SlotHeaders), across real processes (each
with its own resource tracker, as target and draft have): a published header reads whole in the other
process, an invalidated slot reads as empty, and the side that attached never unlinks the segment
(only its owner does)."""
import json
import subprocess
import sys

from cluster import REPO
from services.bridge.ipc import SlotHeaders

READER = ("import json, sys; from services.bridge.ipc import SlotHeaders; h = SlotHeaders(4, sys.argv[1]); "
          "print(json.dumps([h.read(s) for s in range(4)])); h.close()")


def test_slot_headers_cross_processes():
    owner = SlotHeaders(4)
    try:
        owner.publish(1, 9, 4, 4096, 2)
        owner.publish(2, 10, 1, 4096, 2)
        owner.invalidate(2)                                    # an overwrite is being queued
        for _ in range(2):                                     # the second reader: still there after the first
            out = subprocess.run([sys.executable, "-c", READER, owner.name], cwd=REPO, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
            seen = json.loads(out.stdout)
            assert seen[1] == [9, 4, 4096, 2]
            assert seen[2][0] == -1 and seen[0][0] == -1 and seen[3][0] == -1
    finally:
        owner.close()
