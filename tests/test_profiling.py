"""services/profiling.py: TANDEM_PROFILE_DIR records calls SKIP + 1 .. SKIP + COUNT of a streamed method and writes
its Chrome trace and operator table once the last one is done; without the variable it records nothing."""
import gzip
import json

import torch

from services import profiling


def test_a_window_of_calls_is_recorded_and_written(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_PROFILE_CALLS", "2,3")
    monkeypatch.setattr(profiling, "_windows", {})
    for i in range(6):
        with profiling.call("tandem.v1.TargetService/Verify"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        written = sorted(p.name for p in tmp_path.iterdir())
        assert len(written) == (2 if i >= 4 else 0), (i, written)      # after call 5 (2 skipped + 3)
    trace = json.loads(gzip.open(next(tmp_path.glob("Verify-*.json.gz"))).read())
    marks = [e for e in trace["traceEvents"] if e.get("name") == "Verify" and e.get("ph") == "X"]
    assert len(marks) == 3                                              # calls 3, 4, 5
    assert "aten::mm" in next(tmp_path.glob("Verify-*.txt")).read_text()


def test_overlapping_calls_close_the_window(tmp_path, monkeypatch):
    """A draft's pushed Propose and the gateway's collect of it run at once on two lane threads: the window's
    last call may still run when the next one begins, and the window is written all the same (once as many
    calls have ended as the window's last), whichever thread ends it."""
    import threading
    monkeypatch.setattr(profiling, "DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_PROFILE_CALLS", "1,3")         # calls 2..4
    monkeypatch.setattr(profiling, "_windows", {})
    method = "tandem.v1.DraftService/Propose"
    for _ in range(3):                                        # calls 1..3
        with profiling.call(method):
            torch.ones(8, 8) @ torch.ones(8, 8)
    begun, release = threading.Event(), threading.Event()

    def last_call():                                          # call 4, still running while call 5 begins
        with profiling.call(method):
            begun.set()
            release.wait(timeout=30)
    t = threading.Thread(target=last_call)
    t.start()
    assert begun.wait(timeout=30)
    with profiling.call(method):                              # call 5
        pass
    release.set()
    t.join(timeout=30)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gz", ".txt"]


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "DIR", "")
    monkeypatch.setattr(profiling, "_windows", {})
    with profiling.call("tandem.v1.DraftService/Propose"):
        pass
    assert profiling._windows == {}
