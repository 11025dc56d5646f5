"""Benchmarks of issue 7 on CPU: random-weight presets, synthetic acceptance, `tandem bench speed` through a
real served cluster (with the per-round split and the in-process baseline), `bench floor` and `bench bridge`."""
import json
import subprocess
import sys

import grpc
import pytest
import torch

from models.model import DraftModel, TargetModel
from models.presets import build_random, parse_random_id, random_identity, random_model_id
from services.identity import model_identity
from services.sampling import Sampling
from services.target.synthetic import R1_LIKE, expected_acceptance_length, parse_profile, synthetic_accept
from tandem.bench_inprocess import make_engines, run_loop

TINY = random_model_id("tiny", 0)


def test_random_preset_shares_embedding_and_head_and_identity():
    target, draft = build_random(TargetModel, TINY), build_random(DraftModel, TINY)
    assert torch.equal(target.model.embed_tokens.weight, draft.embed_tokens.weight)
    assert torch.equal(target.lm_head.weight, draft.lm_head.weight)
    assert torch.equal(build_random(TargetModel, TINY).model.layers[1].mlp.gate.weight,
                       target.model.layers[1].mlp.gate.weight)            # seeded: the same in every process
    assert parse_random_id(TINY) == ("tiny", 0)
    assert model_identity(TINY) == random_identity(TINY) != model_identity(random_model_id("tiny", 1))
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        random_model_id("nope", 0)


def test_acceptance_profiles_parse_and_published_r1_lengths_follow():
    assert parse_profile("0.85") == (0.85,) and parse_profile("0.92,0.72,0.36") == R1_LIKE
    assert parse_profile("") is None and parse_profile("-1") is None
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        parse_profile("0.9,1.2")
    # TensorRT-LLM's DeepSeek-R1 MTP accept lengths with 1 / 2 / 3 drafts: 1.92 / 2.58 / 2.82
    assert [round(expected_acceptance_length(R1_LIKE, k), 2) for k in (1, 2, 3)] == [1.92, 2.58, 2.82]


@pytest.mark.parametrize("p,k", [((0.85,), 3), ((0.5,), 4), ((0.0,), 2), ((1.0,), 3), ((0.92, 0.72, 0.36), 3),
                                 ((0.9, 0.5), 4)])
def test_synthetic_acceptance_follows_its_profile(p, k):
    n = 4000
    target = torch.randint(100, 200, (n, k + 1))
    drafts = torch.randint(0, 100, (n, k))                  # never the target's tokens
    accepted, emitted = synthetic_accept(target, drafts, torch.full((n,), k), p, [[i, 0] for i in range(n)])
    mal = 1 + accepted.float().mean().item()
    assert abs(mal - expected_acceptance_length(p, k)) < 0.06, (mal, expected_acceptance_length(p, k))
    for i in range(k):                                      # position i accepted given i - 1 was: P_i
        reached = (accepted >= i).sum().item()
        if reached > 200:
            rate = (accepted >= i + 1).sum().item() / reached
            assert abs(rate - p[min(i, len(p) - 1)]) < 0.05, (i, rate, p)
    for b in range(50):                                     # accepted drafts, then the target's own token
        a = int(accepted[b])
        assert emitted[b, :a].tolist() == drafts[b, :a].tolist() and int(emitted[b, a]) == int(target[b, a])
        assert (emitted[b, a + 1:] == -1).all()


def test_synthetic_acceptance_with_mixed_draft_counts_takes_each_requests_own_draws():
    """Requests of one Verify with 0..K drafts (adaptive K): request b's acceptance is decided by its own keyed
    uniforms (seed, draw) alone (a seeded request accepts alike in any batch), never past its k_b drafts, and its
    next Verify (draw + 1) draws anew."""
    from kernels.noise import draw_keys, uniform
    n, K, p = 300, 4, (0.9, 0.6)
    g = torch.Generator().manual_seed(0)
    target, drafts = torch.randint(100, 200, (n, K + 1), generator=g), torch.randint(0, 100, (n, K), generator=g)
    k = torch.randint(0, K + 1, (n,), generator=g)
    seeds, draws = [1000 + b for b in range(n)], [b % 5 for b in range(n)]
    states = [[s, d] for s, d in zip(seeds, draws)]
    accepted, emitted = synthetic_accept(target, drafts, k, p, states)
    assert [st[1] for st in states] == [d + 1 for d in draws]         # one draw taken a Verify
    for b in range(n):
        u = uniform(draw_keys(torch.tensor([seeds[b]]), torch.tensor([draws[b]])), K)[0, : int(k[b])].tolist()
        a = next((i for i, x in enumerate(u) if x >= p[min(i, len(p) - 1)]), int(k[b]))
        assert int(accepted[b]) == a <= int(k[b])
        assert emitted[b].tolist() == drafts[b, :a].tolist() + [int(target[b, a])] + [-1] * (K - a)
    alone = synthetic_accept(target[7:8], drafts[7:8], k[7:8], p, [[seeds[7], draws[7]]])
    assert int(alone[0][0]) == int(accepted[7]) and torch.equal(alone[1][0], emitted[7])
    full = torch.full((n,), K)
    again = [synthetic_accept(target, drafts, full, p, states)[0] for _ in (1, 2)]
    assert not torch.equal(again[0], again[1])             # each Verify its own draws


def test_synthetic_acceptance_in_the_engine_rolls_back_like_a_rejection():
    te, de = make_engines(TINY, synthetic_acceptance=(0.8,))
    prompts = [[(7 * i + j) % 500 for j in range(12)] for i in range(4)]
    r = run_loop(te, de, prompts, k=3, batch=4, max_tokens=60)
    assert 2.5 < 1 + r.accepted / r.drafts < 3.4, 1 + r.accepted / r.drafts     # expected 2.95
    assert all(len(o) == 60 for o in r.outputs.values())
    assert not te.requests and te.cache.num_free_blocks == te.cache.num_blocks   # all released
    te.prefill([("x", prompts[0], Sampling(seed=1))])
    for _ in range(5):                                      # cache holds every committed token but the pending one
        te.verify([("x", [1, 2, 3], None)])
        assert te.cache.length("x") == te.requests["x"].num_tokens - 1


def test_inprocess_greedy_speculation_equals_target_only():
    te, de = make_engines(TINY)
    prompts = [[(11 * i + 3 * j) % 500 for j in range(10 + i)] for i in range(3)]
    plain = run_loop(te, de, prompts, k=0, batch=2, max_tokens=12)
    spec = run_loop(te, de, prompts, k=2, batch=2, max_tokens=12)
    assert spec.drafts > 0 and plain.drafts == 0
    assert spec.outputs == plain.outputs


def test_the_inprocess_grid_frees_its_engines_before_a_served_run_starts():
    """On a GPU the served grid's next cluster starts right after `run_grid`: its engines (reference cycles) must be
    gone by then, not at some later collection (on an H100 the next target ran out of memory)."""
    import gc
    import types
    from services.target.engine import TargetEngine
    from tandem.bench_inprocess import run_grid
    a = types.SimpleNamespace(ks="0,2", batches="1", requests_per_batch=1, max_tokens=4, prompt_tokens=8,
                              device="cpu", dtype="", synthetic_acceptance="0.85")
    gc.collect()
    assert len(run_grid(TINY, a)) == 2
    alive = sum(isinstance(o, TargetEngine) for o in gc.get_objects())   # (no collection in between)
    assert alive == 0, f"{alive} target engines still alive after run_grid returned"


def test_the_inprocess_grid_repeats_each_row_with_its_ks_interleaved():
    """--repeats measures the in-process rows as often as the served ones (a GPU's single in-process run moved 7 %
    between calls), the Ks' order reversed every other repeat as the served modes are."""
    import types
    from tandem.bench_inprocess import run_grid
    a = types.SimpleNamespace(ks="0,2", batches="1", requests_per_batch=1, max_tokens=4, prompt_tokens=8,
                              device="cpu", dtype="", synthetic_acceptance="0.85", repeats=2)
    rows = run_grid(TINY, a)
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 0), (1, 2), (1, 2), (1, 0)]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_bench_speed_served_split_and_inprocess(tmp_path):
    """The whole CLI: starts `tandem serve --random-config tiny --synthetic-acceptance`, measures, stops."""
    cmd = [sys.executable, "-m", "tandem", "bench", "speed", "--random-config", "tiny", "--ks", "0,2",
           "--batches", "1,2", "--max-tokens", "8", "--requests-per-batch", "1", "--prompt-tokens", "16",
           "--synthetic-acceptance", "0.9", "--synthetic-acceptance", "0.95,0.2", "--in-process", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "BENCHMARK ONLY" in proc.stderr and "WARNING" in proc.stderr
    md = (tmp_path / "speed.md").read_text()
    for col in ("propose ms", "transfer ms", "verify ms", "gateway ms", "served / in-process", "BENCHMARK ONLY",
                "ideal round ms", "served of ideal", "batch slots filled"):
        assert col in md, col
    assert "expected mean acceptance length at K = 2: 2.71 / 2.14" in md      # 1 + p1 + p1 p2 per profile
    rows = json.loads((tmp_path / "speed.json").read_text())
    assert [(r["acceptance"], r["batch"], r["k"]) for r in rows] == [
        (p, b, k) for p in ("0.9", "0.95,0.2") for b in (1, 2) for k in (0, 2)]
    for r in rows:                                          # the roofline: floors of verify and draft steps
        assert r["verify_floor_ms"] > 0 and (r["draft_floor_ms"] > 0) == (r["k"] > 0)
        assert 0 < r["of_ideal"] <= 1.05, r                 # nothing beats its byte floor (measured bandwidth)
        assert r["tokens"] == 8 * r["batch"] and r["rounds"] > 0
        assert 0 < r["slots_filled"] <= 1, r                # request-rounds over rounds x batch
        assert 0 <= r["joins_with_ahead"] <= r["prefills_in_verify"] and (r["k"] > 0 or not r["joins_with_ahead"]), r
        s = r["ms_per_round"]
        assert s["round"] > 0 and s["verify"] > s["target_compute"] > 0
        # overlapped rounds: "propose" is the wait the commit did not hide, so it may be below draft compute. At
        # K = 0 the draft only takes the prompts (its prefix cache), in the Propose a mixed prefill's round sends
        assert s["propose"] > 0 and s["draft_compute"] > 0 if r["k"] > 0 else s["draft_compute"] < s["target_compute"]
        assert r["inprocess_tokens_per_s"] > 0
        # request i is seeded alike on both sides, so the synthetic draws, and the acceptance, are the same
        assert r["inprocess_mean_acceptance_length"] == pytest.approx(r["mean_acceptance_length"]), r
    assert all(r["mean_acceptance_length"] > 1.5 for r in rows if r["k"] == 2)      # synthetic, p = 0.9
    assert (tmp_path / "speed.png").stat().st_size > 0


def test_gateway_without_tokenizer_takes_token_ids_only():
    from tandem.bench import start_cluster, stop_cluster
    from tandem.v1 import generate_pb2, generate_pb2_grpc
    proc, addr, http = start_cluster(None, 2, ["--random-config", "tiny", "--seed", "3"])
    try:
        stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(addr))
        r = stub.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]), max_tokens=4,
                                                       ignore_eos=True), timeout=60)
        assert len(r.token_ids) == 4 and r.text == ""
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(generate_pb2.GenerateRequest(text="hello", max_tokens=4), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tokenizer" in e.value.details()
        import httpx
        resp = httpx.post(f"http://{http}/v1/completions", json={"model": "random-tiny", "prompt": "hi"}, timeout=30)
        assert resp.status_code == 400 and "no tokenizer" in resp.json()["error"]["message"], resp.text
        resp = httpx.post(f"http://{http}/v1/completions", json={"model": "random-tiny", "prompt": [1, 2, 3],
                                                                 "max_tokens": 3, "temperature": 0}, timeout=30)
        assert resp.status_code == 200, resp.text
    finally:
        stop_cluster(proc)


def test_bench_floor_on_cpu(tmp_path):
    from tandem.bench_floor import main
    assert main(["--random-config", "tiny", "--batches", "1,4", "--ks", "0,3", "--prompt-tokens", "16",
                 "--warmup", "1", "--iters", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "floor.json").read_text())
    assert data["copy_bandwidth_bytes_per_s"] > 0
    assert [(r["batch"], r["k"]) for r in data["rows"]] == [(1, 0), (1, 3), (4, 0), (4, 3)]
    one, four = data["rows"][0], data["rows"][3]
    assert 1 <= one["experts_per_layer"] <= 2 < four["experts_per_layer"] <= 8      # top-2 of 8, counted by hooks
    assert all(r["ratio"] > 0 and r["mb_read"] > 0 for r in data["rows"])
    assert "time / floor" in (tmp_path / "floor.md").read_text()


def test_bench_bridge_over_gloo(tmp_path):
    from tandem.bench_bridge import main
    assert main(["--device", "cpu", "--batches", "1,8", "--warmup", "2", "--iters", "5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bridge.json").read_text())
    assert [r["rows"] for r in rows] == [4, 32] and all(r["bridge_us"] > 0 and r["bare_us"] > 0 for r in rows)
    assert all(0 < r["landed_take_us"] < r["bridge_us"] for r in rows), rows     # pushed: landed before the take


def test_bench_bridge_times_a_ring_take(tmp_path):
    """The ring path (CUDA IPC on one GPU, here the CPU's shared-memory ring): pushed and taken in turn, each
    transfer compared bitwise in the draft's worker, with the take's finiteness check timed beside it."""
    from tandem.bench_bridge import main
    assert main(["--device", "cpu", "--transport", "shm", "--batches", "1,8", "--warmup", "2", "--iters", "5",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bridge.json").read_text())
    assert [(r["transport"], r["rows"]) for r in rows] == [("shm", 4), ("shm", 32)]
    assert all(r["bridge_us"] > 0 and r["bare_us"] > 0 and r["check_us"] > 0 and r["checked_take_us"] > 0
               for r in rows), rows
    assert "shared-memory ring" in (tmp_path / "bridge.md").read_text()


def test_cuda_graph_scratch_block_is_not_reported_as_used():
    # GraphedForward holds one cache block for its padding tokens' writes; GetInfo must not count it as
    # used, or an idle GPU service looks like it leaked a block (free != total with no request running)
    from types import SimpleNamespace

    from models.cuda_graphs import GraphedForward
    from services.servicer import service_info
    te, _ = make_engines(TINY)
    te.forward = GraphedForward(te.model, te.cache, te.model.cfg.hidden_size, torch.float32, te.max_model_len)
    info = service_info(SimpleNamespace(model=TINY, request_idle_s=600.0), te, 0)
    assert info.kv_blocks_free == info.kv_blocks_total == te.cache.num_blocks - 1


def test_gateway_takes_random_config_or_model_not_both():
    from gateway.server import parse
    cfg = parse(["--random-config", "tiny"])
    assert cfg.model_name == "random-tiny" and cfg.random_config == "tiny"
    with pytest.raises(SystemExit):
        parse(["--random-config", "tiny", "--model", "checkpoints/tandem-code-mini"])


@pytest.mark.parametrize("preset", ["v2-lite", "tiny"])
def test_prefill_flop_count_is_the_models_parameters(preset):
    """tandem bench prefill-speed's floor: per token 2 FLOPs per weight a token multiplies (every attention, dense
    MLP, router and shared-expert weight, top-k of the routed experts; counted here from the model's own
    parameters on the meta device), plus the causal pairs' qk + v and one LM head row."""
    from models.loader import build
    from models.presets import preset_config
    from tandem.bench_prefill_speed import forward_flops
    cfg = preset_config(preset)
    m = build(TargetModel, cfg, device="meta")
    per_token = 0
    for name, p in m.named_parameters():
        if name.startswith("model.layers.") and "norm" not in name and not name.endswith("correction_bias"):
            experts = ".mlp.experts." in name
            per_token += p.numel() * (cfg.num_experts_per_tok / cfg.n_routed_experts if experts else 1)
    pairs = lambda n, s: n * s + n * (n + 1) // 2                          # noqa: E731
    attention = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    for n, start in ((1, 0), (100, 0), (37, 250)):
        want = 2 * per_token * n + attention * pairs(n, start) + head
        assert forward_flops(cfg, n, start) == pytest.approx(want, rel=1e-9), (n, start)


def test_bench_speed_with_queued_clients(tmp_path):
    """--clients queued: every request at once to a gateway per batch size started with --max-batch, so no round
    holds more than `batch` decoding requests (slots filled <= 1) while the others wait for a slot."""
    cmd = [sys.executable, "-m", "tandem", "bench", "speed", "--random-config", "tiny", "--ks", "0,2", "--batches",
           "1,2", "--max-tokens", "8", "--requests-per-batch", "3", "--prompt-tokens", "16", "--clients", "queued",
           "--synthetic-acceptance", "0.9", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sent at once, at most batch a round" in (tmp_path / "speed.md").read_text()
    rows = json.loads((tmp_path / "speed.json").read_text())
    assert [(r["batch"], r["k"], r["clients"]) for r in rows] == [(b, k, "queued") for b in (1, 2) for k in (0, 2)]
    for r in rows:
        # without the cap all 3 x batch would decode together: 3 x batch request-rounds a round, slots filled ~3
        assert r["tokens"] == 8 * 3 * r["batch"] and 0 < r["slots_filled"] <= 1, r


def test_bench_speed_fixed_and_adaptive_repeats(tmp_path):
    """Both speculation modes, a gateway each on one target and draft, every row measured twice (the modes' order
    alternating)."""
    cmd = [sys.executable, "-m", "tandem", "bench", "speed", "--random-config", "tiny", "--ks", "0,2",
           "--batches", "2", "--max-tokens", "6", "--requests-per-batch", "1", "--prompt-tokens", "12",
           "--synthetic-acceptance", "0.9", "--speculation", "fixed,adaptive", "--repeats", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "speed.json").read_text())
    assert [(r["speculation"], r["k"]) for r in rows] == [("fixed", 0), ("fixed", 2), ("adaptive", 2)]
    for r in rows:
        assert len(r["tokens_per_s_runs"]) == 2 and all(t > 0 for t in r["tokens_per_s_runs"]) and r["spread"] >= 0
        assert r["tokens"] == 6 * 2
    assert 0 <= rows[-1]["mean_k"] <= 2
    served = [line.split()[4] for line in proc.stdout.splitlines() if line.startswith("served ")]
    assert served == ["fixed", "fixed", "adaptive", "adaptive", "fixed", "fixed"], served   # order reversed in repeat 2
    assert proc.stdout.count("tandem: serving") == 1 and proc.stdout.count("tandem bench: added a gateway") == 1


def test_bench_gateway_commits_every_token(tmp_path):
    """`tandem bench gateway`: the Scheduler over services that answer at once, each request to its last token."""
    out = tmp_path / "gw.json"
    proc = subprocess.run([sys.executable, "-m", "tandem", "bench", "gateway", "--batches", "1,4", "--output-tokens",
                           "40", "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["output_tokens"]) for r in rows] == [(1, 40), (4, 40)]
    for r in rows:      # ~1 + 0.92 + 0.66 + 0.24 tokens a round with the R1-like profile: far fewer rounds than tokens
        assert 5 < r["rounds"] < 30 and r["ms_per_round"] > 0, r


def test_bench_acceptance_drafts_k_every_round(tmp_path):
    """`tandem bench acceptance` measures the model at each K: its cluster drafts K every round (--speculation fixed),
    so a K row never makes more than K + 1 tokens per target forward. Under `tandem serve`'s default (adaptive)
    rounds of fewer drafts went uncounted: 3.3-3.8 tokens a forward at K = 1, and pos 3 moved 0.26-0.59 run to run."""
    cmd = [sys.executable, "-m", "tandem", "bench", "acceptance", "--max-k", "2", "--prompts", "3", "--max-tokens",
           "24", "--temperatures", "0,1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(K=2 fixed," in proc.stdout + proc.stderr                    # `tandem serve`'s start line
    rows = json.loads((tmp_path / "acceptance.json").read_text())
    assert [(r["temperature"], r["k"]) for r in rows] == [(t, k) for t in (0.0, 1.0) for k in (1, 2)]
    for r in rows:
        assert r["drafts"] > 0 and 1 <= r["mean_acceptance_length"] <= r["k"] + 1, r
        assert r["tokens_per_forward"] <= r["k"] + 1, r


def test_bench_speed_halves_splits_the_batch_over_two_gateways(tmp_path):
    """A /halves mode: two gateways on the one target and draft, each running rounds over its half of the clients
    (issue 14, item 4: two micro-batches alternating), beside the same mode on one gateway."""
    cmd = [sys.executable, "-m", "tandem", "bench", "speed", "--random-config", "tiny", "--ks", "0,2", "--batches",
           "4", "--max-tokens", "6", "--requests-per-batch", "2", "--prompt-tokens", "12", "--synthetic-acceptance",
           "0.9", "--speculation", "fixed/no-busy-poll,fixed/halves/no-busy-poll", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "speed.json").read_text())
    assert [(r["speculation"], r["k"], r["gateways"]) for r in rows] == [
        ("fixed/no-busy-poll", 0, 1), ("fixed/no-busy-poll", 2, 1),
        ("fixed/halves/no-busy-poll", 0, 2), ("fixed/halves/no-busy-poll", 2, 2)]
    for r in rows:
        assert r["tokens"] == 6 * 4 * 2 and len(r["rounds_by_gateway"]) == r["gateways"]
        assert all(n > 0 for n in r["rounds_by_gateway"]), r["rounds_by_gateway"]    # both halves decoded
    assert proc.stdout.count("tandem: serving") == 1 and proc.stdout.count("tandem bench: added a gateway") == 2
    assert "2 halves/no-busy-poll" in (tmp_path / "speed.md").read_text()
