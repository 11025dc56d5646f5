# Session 23, call B: (1) how long cudaGraphLaunch of the served V2-Lite target step takes on the host (the GPU starts
# the graph only when the call returns), (2) whether the step's graph split into P pieces, launched back to back
# (the GPU runs piece 1 while the host launches the rest), pays; one process, variants interleaved in blocks;
# (3) a graph of 400 trivial kernels, for the launch cost a node.
import dataclasses, statistics, sys, time, types
import torch
from models.presets import random_model_id
from services.sampling import Sampling
from tandem.bench_fp8_models import _engine

te = _engine(random_model_id("v2-lite", 0), types.SimpleNamespace(device="cuda", small=False), "none", blocks=32 * 16 + 64)
m, cache, gf = te.model, te.cache, te.forward
L = len(m.model.layers)


def piece_fns(P):
    bounds = [round(i * L / P) for i in range(P + 1)]
    def make(i):
        a, b = bounds[i], bounds[i + 1]
        def f(state, batch):
            x, pending = (m.model.embed_tokens(state), None) if i == 0 else state
            for j in range(a, b):
                x, pending = m.model.layers[j].step(x, pending, batch, cache.layer(j))
            return m.model.norm.add(x, pending)[1] if i == P - 1 else (x, pending)
        return f
    return [make(i) for i in range(P)]


def capture_pieces(stage, P):
    full = stage.batch()
    batch = dataclasses.replace(full, query_lens=[stage.n // stage.b] * stage.b, attention_backend="triton",
                                request_ids=[f"\0pad{i}" for i in range(stage.b)], block_size=cache.block_size)
    fns, s = piece_fns(P), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(2):
            st = full.input_ids
            for f in fns:
                st = f(st, batch)
    torch.cuda.current_stream().wait_stream(s)
    graphs, st = [], full.input_ids
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(g, pool=gf.pool, stream=s, capture_error_mode="thread_local"):
            st = f(st, batch)
        gf.pool = g.pool()
        graphs.append(g)
    return graphs, st


def timed(launch, n=30):
    host, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); launch(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        host.append(t1 - t0); wall.append(t2 - t0)
    return host, wall


for B in (1, 32):
    ids = [f"x{B}-{i}" for i in range(B)]
    te.prefill([(r, list(range(5, 69)), Sampling()) for r in ids])
    batch = cache.prepare(ids, [1] * B, [7] * B)
    with torch.inference_mode():
        whole_out = gf(batch.input_ids, batch, cache).clone()
    stage = gf.stage(B, B, 1)
    graph, out = gf.graphs[(stage.b, stage.n)]
    variants = {"whole": (lambda g=graph: g.replay(), out)}
    for P in (1, 2, 4, 8):
        gs, o = capture_pieces(stage, P)
        variants[f"P{P}"] = ((lambda gs=gs: [g.replay() for g in gs]), o)
    res = {k: ([], []) for k in variants}
    for block in range(5):
        for k, (launch, _) in variants.items():
            h, w = timed(launch)
            res[k][0].extend(h); res[k][1].extend(w)
    for k, (launch, o) in variants.items():
        launch(); torch.cuda.synchronize()
        same = torch.equal(o[:B], out[:B])
        print(f"== batch {B} {k}: launch (host) {1e6 * statistics.median(res[k][0]):.0f} us, wall {1e3 * statistics.median(res[k][1]):.3f} ms "
              f"(p10 {1e3 * sorted(res[k][1])[15]:.3f}, p90 {1e3 * sorted(res[k][1])[135]:.3f}); output equal to whole: {same}", flush=True)
    te.release(ids)

x = torch.zeros(1, device="cuda")
for nodes in (100, 400):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    h, w = timed(g.replay, 50)
    print(f"== trivial graph of {nodes} kernels: launch (host) {1e6 * statistics.median(h):.0f} us, wall {1e3 * statistics.median(w):.3f} ms")
