import os, time, sys, statistics
r1, w1 = os.pipe(); r2, w2 = os.pipe()
busy = float(sys.argv[1]); spin = len(sys.argv) > 2
pid = os.fork()
if pid == 0:   # responder: reads a request, computes `busy` seconds, writes its stamp
    while True:
        b = os.read(r1, 8)
        if not b: os._exit(0)
        t = time.perf_counter()
        while time.perf_counter() - t < busy: pass
        os.write(w2, str(time.perf_counter()).encode().ljust(32))
lat = []
for i in range(200):
    os.write(w1, b"x")
    if spin:
        os.set_blocking(r2, False)
        while True:
            try:
                b = os.read(r2, 32); break
            except BlockingIOError: pass
    else:
        os.set_blocking(r2, True)
        b = os.read(r2, 32)
    lat.append(time.perf_counter() - float(b))
os.close(w1)
print(f"busy {busy*1e3:.0f} ms spin={spin}: wake median {statistics.median(lat)*1e6:.0f} us p90 {sorted(lat)[180]*1e6:.0f} us")
