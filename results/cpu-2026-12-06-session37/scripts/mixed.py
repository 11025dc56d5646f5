import asyncio, httpx, time, json, random
from common import U, post
random.seed(7)
def fresh(n):   # random in-vocab ids: no prefix-cache hits
    return [random.randrange(300, 8000) for _ in range(n)]
async def ttft(cl, prompt, mt=1):
    t0 = time.time()
    async with cl.stream("POST", U + "/v1/completions", json={"prompt": prompt, "max_tokens": mt, "stream": True, "temperature": 0, "ignore_eos": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"): return time.time() - t0
async def bg(cl, prompt, stop_ev):
    async with cl.stream("POST", U + "/v1/completions", json={"prompt": prompt, "max_tokens": 1000, "stream": True, "temperature": 0, "ignore_eos": True}) as r:
        async for line in r.aiter_lines():
            if stop_ev.is_set(): return
async def main():
    L, B = 800, 6
    async with httpx.AsyncClient(timeout=900) as cl:
        print("alone TTFT %.1fs" % await ttft(cl, fresh(L)))
        stop_ev = asyncio.Event()
        tasks = [asyncio.create_task(bg(cl, fresh(L), stop_ev)) for _ in range(B)]
        await asyncio.sleep(1)
        while True:     # wait until all B are decoding
            m = httpx.get(U + "/metrics").text
            run = [l for l in m.splitlines() if l.startswith("tandem:num_requests_running{")][0]
            if float(run.split()[-1]) >= B: break
            await asyncio.sleep(1)
        await asyncio.sleep(2)
        print("with %d decoding (%d-token contexts): TTFT %.1fs" % (B, L, await ttft(cl, fresh(L))))
        stop_ev.set()
        for t in tasks: t.cancel()
asyncio.run(main())
