import os, signal, subprocess, sys, time, threading, tempfile, json
from pathlib import Path
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import httpx
from cluster import make_checkpoint
from infra.ports import free_ports
d = Path(tempfile.mkdtemp()); ckpt = make_checkpoint(d / "tiny", seed=3)
g, h, t, dr, b, di = free_ports(6)
cmd = [sys.executable, "-m", "tandem", "serve", "--model", str(ckpt), "-k", "3", "--grpc-port", str(g), "--http-port", str(h),
       "--target-port", str(t), "--draft-port", str(dr), "--bridge-port", str(b), "--dist-port", str(di), "--drain-timeout", "3"]
log = open(d / "serve.log", "wb")
p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
url = f"http://127.0.0.1:{h}"
for _ in range(300):
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.5)
ends = []
def stream(i):
    body = {"prompt": [5 + i, 6, 7], "max_tokens": 1900, "ignore_eos": True, "stream": True}
    last = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "): last = line[:120]
    except Exception as e: last = f"EXC {type(e).__name__}"
    ends.append(last)
ts = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
[x.start() for x in ts]; time.sleep(4)
os.killpg(p.pid, signal.SIGINT)         # a terminal's Ctrl-C: the whole group
t0 = time.time(); rc = p.wait(timeout=120); [x.join(30) for x in ts]
print("serve rc", rc, "in %.1f s" % (time.time() - t0))
print("stream ends:", ends)
print("\n".join(l for l in (d / "serve.log").read_text(errors="replace").splitlines() if "exit" in l or "Abort" in l or "terminate" in l or "draining" in l or "failing" in l))
