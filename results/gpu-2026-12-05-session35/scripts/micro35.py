# session 35 (not part of Tandem): host time of small per-round CUDA calls on this host, us per call (median of 5 x 200)
import statistics, time, torch
from services.bridge.rows import finite_flag
dev = torch.device("cuda")
rows = torch.randn(128, 2048, device=dev, dtype=torch.bfloat16)
parts = list(rows.split([4] * 32))
ev = torch.cuda.Event()
s = torch.cuda.current_stream()
def t(name, fn, n=200):
    fn(); torch.cuda.synchronize()
    xs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        xs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    print(f"{name:50s} {statistics.median(xs):8.2f} us")
t("finite_flag([128, 2048] bf16)", lambda: finite_flag(rows))
t("torch.empty((), bool, pin_memory=True)", lambda: torch.empty((), dtype=torch.bool, pin_memory=True))
t("rows.sum(fp32) + isfinite", lambda: torch.isfinite(rows.sum(dtype=torch.float32)))
t("torch.cat(32 views of 4 rows)", lambda: torch.cat(parts))
t("rows.split([4]*32)", lambda: rows.split([4] * 32))
t("32 x rows[i:i+4]", lambda: [rows[i:i + 4] for i in range(0, 128, 4)])
t("torch.tensor(32 ints).to(dev, non_blocking)", lambda: torch.tensor(list(range(32))).to(dev, non_blocking=True))
t("rows[idx] (idx on device, 32)", lambda: rows[torch.arange(32, device=dev)])
t("event.record + stream.wait_event", lambda: (ev.record(s), s.wait_event(ev)))
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev))
t("tensor.record_stream", lambda: rows.record_stream(s))
t("stream.synchronize (idle)", lambda: s.synchronize())
small = torch.zeros(32, 4, dtype=torch.int64, device=dev)
t("small.cpu() [32,4] int64", lambda: small.cpu())
t("small.tolist() via cpu", lambda: small.cpu().tolist())
