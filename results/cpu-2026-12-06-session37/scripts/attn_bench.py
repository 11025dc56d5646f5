import time, torch
torch.set_num_threads(1)
from kernels.mla import latent_attention, _padded_attention
from models.kv_cache import PagedKVCache
H, R, P, BS = 8, 128, 16, 16   # the bundled model's MLA: 8 heads, kv_lora 128, rope 16
cache = PagedKVCache(1, 1024, BS, R, P, dtype=torch.float32, device="cpu")
hist = {f"d{i}": 800 for i in range(6)}
for r in hist: cache.allocate(r)
cache.prepare(list(hist), list(hist.values()))
cache.allocate("new")
step = {**{f"d{i}": 1 for i in range(6)}, "new": 800}
b = cache.prepare(list(step), list(step.values()))
n = b.num_tokens; ql, qp = torch.randn(n, H, R), torch.randn(n, H, P)
for name, fn in [("grouped", lambda: latent_attention(ql, qp, b, cache.ckv[0], cache.kpe[0], 0.1)),
                 ("all padded", lambda: _padded_attention(ql, qp, *b._padded(list(range(7))), cache.ckv[0], cache.kpe[0], 0.1))]:
    fn(); t = time.perf_counter(); [fn() for _ in range(3)]; print(name, f"{(time.perf_counter() - t) / 3 * 1000:.1f} ms a layer")
