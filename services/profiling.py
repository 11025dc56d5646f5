"""TANDEM_PROFILE_DIR=DIR (development): a service records its streamed calls under torch.profiler and writes
what it saw, to find where a served step's time goes beside its in-process twin (issue 14).

TANDEM_PROFILE_CALLS=SKIP,COUNT (default 50,20): calls SKIP + 1 .. SKIP + COUNT of each streamed method are
recorded, each marked on the timeline by a record_function named after the method, with the idle time between
them. Once as many calls have ended as the window's last (calls of one method may overlap: a draft's pushed
Propose and its collect) the service writes DIR/<method>-<pid>.json.gz (a Chrome trace: host and device on one
timeline) and DIR/<method>-<pid>.txt (operators by device time). Without the variable nothing is imported.
"""
from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tempfile
import threading

DIR = os.environ.get("TANDEM_PROFILE_DIR", "")
_windows: dict[str, "_Window"] = {}


class _Window:
    def __init__(self, method: str):
        skip, count = (int(x) for x in os.environ.get("TANDEM_PROFILE_CALLS", "50,20").split(","))
        self.name = method.rsplit("/", 1)[-1]
        self.first, self.last, self.calls, self.prof = skip + 1, skip + count, 0, None
        self.ended, self.lock = 0, threading.Lock()   # calls of one method may overlap (a pushed Propose, a collect)

    def begin(self) -> None:
        with self.lock:
            self.calls += 1
            first = self.calls == self.first
        if first:
            import torch
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def end(self) -> None:
        with self.lock:
            self.ended += 1
            if self.prof is None or self.ended < self.last:   # written once as many calls have ended as began
                return                                        # by the window's last
            prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(DIR, exist_ok=True)
        base = os.path.join(DIR, f"{self.name}-{os.getpid()}")
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(base + ".json.gz", "wb") as g:
                shutil.copyfileobj(f, g)
        sort = "self_cuda_time_total" if any(e.device_type.name == "CUDA" for e in prof.events()) else "self_cpu_time_total"
        with open(base + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60))


@contextlib.contextmanager
def call(method: str):
    """Around one streamed call of `method` (services/servicer.py): recorded when inside the window."""
    if not DIR:
        yield
        return
    w = _windows.setdefault(method, _Window(method))
    w.begin()
    try:
        if w.prof is None:
            yield
        else:
            import torch
            with torch.profiler.record_function(w.name):
                yield
    finally:
        w.end()
