import sys, time, httpx, torch
sys.path.insert(0, "tests")
from cluster import Cluster, make_checkpoint
from pathlib import Path
import tempfile
d = Path(tempfile.mkdtemp())
ckpt = "checkpoints/tandem-code-mini"
with Cluster(ckpt, k=3, log_dir=d / "logs") as c:
    url = c.gateways[0].http_url
    for n in (1, 8, 8):
        g = torch.Generator().manual_seed(n * 100 + int(time.time()) % 1000)
        prompt = torch.randint(3, 500, (1000,), generator=g).tolist()
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "n": n}, timeout=600)
        print("n", n, r.status_code, "%.2f s" % (time.perf_counter() - t), flush=True)
