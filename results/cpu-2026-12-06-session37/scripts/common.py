import json, httpx, re
U = "http://127.0.0.1:31650"
def post(path, body, **kw):
    return httpx.post(U + path, json=body, timeout=kw.pop("timeout", 120), **kw)
def raw(path, data, headers=None):
    return httpx.post(U + path, content=data, headers=headers or {"Content-Type": "application/json"}, timeout=120)
def metrics():
    t = httpx.get(U + "/metrics").text
    out = {}
    for line in t.splitlines():
        if line.startswith("tandem:") and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out
def gauges():
    m = metrics()
    return {k: v for k, v in m.items() if any(s in k for s in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "request_success_total", "kv_cache_usage"))}
def sse(path, body):
    """-> list of parsed chunks (or raw strings) of a streamed request"""
    out = []
    with httpx.stream("POST", U + path, json=body, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            d = line[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return 200, out
