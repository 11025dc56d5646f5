"""TANDEM_PROFILE_DIR=DIR (development): a service records its streamed calls under torch.profiler and writes
what it saw, to find where a served step's time goes beside its in-process twin (issue 14).

TANDEM_PROFILE_CALLS=SKIP,COUNT (default 50,20): calls SKIP + 1 .. SKIP + COUNT of each streamed method are
recorded, each marked on the timeline by a record_function named after the method, with the idle time between
them. After the last one the service writes DIR/<method>-<pid>.json.gz (a Chrome trace: host and device on one
timeline) and DIR/<method>-<pid>.txt (operators by device time). Without the variable nothing is imported.
"""
from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tempfile

DIR = os.environ.get("TANDEM_PROFILE_DIR", "")
_windows: dict[str, "_Window"] = {}


class _Window:
    def __init__(self, method: str):
        skip, count = (int(x) for x in os.environ.get("TANDEM_PROFILE_CALLS", "50,20").split(","))
        self.name = method.rsplit("/", 1)[-1]
        self.first, self.last, self.calls, self.prof = skip + 1, skip + count, 0, None

    def begin(self) -> None:
        self.calls += 1
        if self.calls == self.first:
            import torch
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def end(self) -> None:
        if self.prof is None or self.calls != self.last:
            return
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
