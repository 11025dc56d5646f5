"""A target SIGKILLed with its whole process group (`kill -9 -PGID`, `timeout -s KILL`, systemd's final kill: its
resource tracker dies with it) left its shared-memory ring (32 MiB of RAM) and slot headers in /dev/shm until
reboot (found probing as an operator). The next sender removes the segments of creators that are gone, and
only those (services/bridge/segments.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cluster import REPO
from services.bridge.shm import ShmSender

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
SENDER = ("import time; from services.bridge.shm import ShmSender; s = ShmSender(capacity=1 << 20, slots=2); "
          "print(s.shm.name, s.headers.name, flush=True); time.sleep(600)")


def sender() -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, "-c", SENDER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return p, p.stdout.readline().split()


def exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def test_a_sender_removes_what_a_killed_group_left_and_nothing_live():
    dead, dead_names = sender()
    live, live_names = sender()
    try:
        assert len(dead_names) == 2 and all(map(exists, dead_names + live_names)), (dead_names, live_names)
        os.killpg(dead.pid, signal.SIGKILL)              # the sender and its resource tracker
        dead.wait(timeout=30)
        time.sleep(0.5)
        assert all(map(exists, dead_names)), "nothing was left to sweep: the test no longer shows the leak"
        s = ShmSender(capacity=1 << 20, slots=2)
        try:
            assert not any(map(exists, dead_names)), dead_names
            assert all(map(exists, live_names)), "a live sender's segments were removed"
        finally:
            s.close()
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait(timeout=30)
        for n in dead_names + live_names:                # (the live one's tracker died with it too)
            if exists(n):
                os.unlink(os.path.join("/dev/shm", n))
