"""Tensor-, expert- and sequence-parallel models against the single-rank model, in-process.

One torch.multiprocessing spawn of 2 gloo ranks runs every layout (tp, ep, sp) in LAYOUTS, one
after the other in the same group: each rank loads the target and the MTP draft with load_model
(only its own slices), runs SCRIPT (prefill and decode steps through the paged cache, with token
counts T = 1, 3 and 19 per step) and sends back the logits; the parent compares them with tp = 1
run in-process. The same spawn checks the row collectives (pad / shard / reduce-scatter /
all-gather round trips) and what the MTP block returns with its SP re-gather skipped (the
TANDEM_FAULT=skip_sp_gather switch): this rank's ceil(T_pad / tp) rows, which the row contract
must refuse naming both counts.
"""
from __future__ import annotations

import math
import queue
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from models.config import ModelConfig
from models.loader import build, load_model
from models.model import DraftModel, TargetModel
from models.moe import MoE
from kernels.dispatch import pad_rows
from kernels.rows import shard_rows
from models.parallel import SINGLE, ParallelState, all_gather_rows, reduce_scatter_rows
from models.runner import forward_tokens, new_cache
from models.tiny import TINY_CONFIG, make_tiny

WORLD = 2
LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, True)]          # (tp, ep, sequence_parallel)
REL_TOL = 1e-4
BLOCK = 4                                                       # small blocks: 19 tokens span 5 of them
SPAWN_TIMEOUT_S = 180


def _ids(n: int, start: int) -> list[int]:
    return [(start + 37 * i) % 509 + 3 for i in range(n)]


# Steps of one paged-cache session: (kind, {request id: new tokens}). Token counts per step (T):
# prefill 19, 3, 1; decode 1, 3; a verify-like decode of several tokens per request, 19; a step
# that prefills one request while decoding another, 3.
SCRIPT = [
    ("prefill", {"a": _ids(19, 5)}),
    ("prefill", {"b": _ids(3, 100)}),
    ("prefill", {"c": _ids(1, 200)}),
    ("decode", {"a": _ids(1, 300)}),
    ("decode", {"a": _ids(1, 301), "b": _ids(1, 302), "c": _ids(1, 303)}),
    ("decode", {"a": _ids(5, 400), "b": _ids(7, 410), "c": _ids(7, 420)}),
    ("prefill+decode", {"d": _ids(2, 500), "b": _ids(1, 510)}),
]
STEP_IDS = [f"{i}-{kind}-T{sum(map(len, seqs.values()))}" for i, (kind, seqs) in enumerate(SCRIPT)]
for _kind in ("prefill", "decode"):
    assert {1, 3, 19} <= {sum(map(len, s.values())) for k, s in SCRIPT if k == _kind}, _kind


@torch.inference_mode()
def run_script(target, draft) -> list[dict]:
    """SCRIPT through the target and, over the target's hidden rows, the MTP draft (each with its
    own paged cache). -> per step: target logits [T, V], draft logits [T, V]."""
    tcache, dcache = new_cache(target, 64, BLOCK), new_cache(draft, 64, BLOCK)
    out = []
    for _, seqs in SCRIPT:
        hidden = forward_tokens(target, tcache, seqs)                           # [T, D]
        for r in seqs:
            if r not in dcache:
                dcache.allocate(r)
        batch = dcache.prepare(list(seqs), [len(s) for s in seqs.values()])
        tokens = torch.tensor([t for s in seqs.values() for t in s])
        dh = draft(tokens, hidden, batch, dcache)                               # [T, D]
        out.append({"target": target.compute_logits(hidden), "draft": draft.compute_logits(dh)})
    return out


def check_row_collectives(ps: ParallelState) -> None:
    """pad -> shard -> (reduce-scatter | all-gather) -> trim gives back exactly the T rows."""
    tp = ps.tp_size
    for T in (1, 2, 3, 19):
        x = torch.arange(T * 5, dtype=torch.float32).view(T, 5) + 1            # identical on every rank
        padded = pad_rows(x, tp)                                                 # [T_pad, 5]
        T_pad = math.ceil(T / tp) * tp
        assert padded.shape == (T_pad, 5) and torch.equal(padded[:T], x) and not padded[T:].any()
        mine = shard_rows(padded, ps.tp_size, ps.tp_rank)                                            # [T_pad / tp, 5]
        assert torch.equal(mine, padded[ps.tp_rank * (T_pad // tp):(ps.tp_rank + 1) * (T_pad // tp)])
        assert torch.equal(all_gather_rows(mine, ps.tp_group, tp)[:T], x), f"all-gather round trip, T={T}"
        partial = pad_rows(x * (ps.tp_rank + 1), tp)                            # partial sums: x, 2x
        summed = reduce_scatter_rows(partial, ps.tp_group, tp)                   # this rank's rows of 3x
        assert summed.shape == (T_pad // tp, 5), f"reduce-scatter shape {tuple(summed.shape)}, T={T}"
        assert torch.equal(all_gather_rows(summed, ps.tp_group, tp)[:T], 3 * x), f"reduce-scatter round trip, T={T}"


@torch.inference_mode()
def skipped_gather_rows(draft, ps: ParallelState) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """T -> (full MTP output [T, D], the output with the SP re-gather skipped) for T = 1, 3, 19."""
    out = {}
    layer = draft.mtp[0]
    for T in (1, 3, 19):
        hidden = torch.randn(T, draft.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
        tokens = torch.tensor(_ids(T, 7))
        got = []
        for skip in (False, True):
            cache = new_cache(draft, 16, BLOCK)
            cache.allocate("r")
            layer.skip_sp_gather = skip
            try:
                got.append(draft(tokens, hidden, cache.prepare(["r"], [T]), cache))
            finally:
                layer.skip_sp_gather = False
        out[T] = tuple(got)
    return out


def _worker(rank: int, port: int, path: str, results) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        check_row_collectives(ParallelState(rank, WORLD, 1, True, dist.group.WORLD))
        for tp, ep, sp in LAYOUTS:
            ps = ParallelState(tp_rank=rank, tp_size=tp, ep_size=ep, sequence_parallel=sp, tp_group=dist.group.WORLD)
            target, draft = load_model(TargetModel, path, ps=ps), load_model(DraftModel, path, ps=ps)
            experts = {m: sorted(int(e) for e in m.experts) for m in [*target.modules(), *draft.modules()]
                       if isinstance(m, MoE)}
            steps = [{k: v.numpy() for k, v in s.items()} for s in run_script(target, draft)]
            faults = ({T: (a.numpy(), b.numpy()) for T, (a, b) in skipped_gather_rows(draft, ps).items()}
                      if sp else None)
            results.put(("layout", rank, (tp, ep, sp), {
                "steps": steps, "faults": faults, "experts": list(experts.values()),
                "lm_head": tuple(target.lm_head.weight.shape), "embed": tuple(draft.embed_tokens.weight.shape),
                "heads": target.model.layers[0].self_attn.heads}))
        dist.destroy_process_group()
        results.put(("done", rank, None, None))
    except BaseException:
        results.put(("error", rank, None, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("par-ckpt") / "tiny", seed=3)


@pytest.fixture(scope="module")
def reference(ckpt):
    torch.set_num_threads(1)
    target, draft = load_model(TargetModel, ckpt), load_model(DraftModel, ckpt)
    return {"steps": run_script(target, draft), "faults": skipped_gather_rows(draft, SINGLE)}


@pytest.fixture(scope="module")
def ranks(ckpt):
    """(layout, rank) -> what that rank computed. One spawn of WORLD ranks for all layouts."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.spawn(_worker, args=(_free_port(), str(ckpt), results), nprocs=WORLD, join=False)
    out, done = {}, 0
    try:
        while done < WORLD:       # read before joining: a child blocks on a full pipe until read
            try:
                kind, rank, layout, payload = results.get(timeout=SPAWN_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"the spawned ranks sent nothing for {SPAWN_TIMEOUT_S}s (hang?)")
            if kind == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            if kind == "done":
                done += 1
            else:
                out[layout, rank] = payload
        procs.join(timeout=60)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    return out


def rel_err(ours, ref) -> float:
    ours, ref = torch.as_tensor(ours), torch.as_tensor(ref)
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def layout_id(layout) -> str:
    tp, ep, sp = layout
    return f"tp{tp}-ep{ep}-sp{'on' if sp else 'off'}"


# --- parity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("step", range(len(SCRIPT)), ids=STEP_IDS)
def test_logits_match_single_rank(ranks, reference, layout, step):
    """Target logits and MTP draft logits, every rank, within 1e-4 relative of tp = 1 (fp32)."""
    T = sum(map(len, SCRIPT[step][1].values()))
    for rank in range(WORLD):
        got = ranks[layout, rank]["steps"][step]
        for which in ("target", "draft"):
            ref = reference["steps"][step][which]
            assert got[which].shape == (T, ref.shape[1]), f"rank {rank} {which}: {got[which].shape} for T={T}"
            err = rel_err(got[which], ref)
            assert err < REL_TOL, f"rank {rank} {which} logits, T={T}: relative error {err:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_ranks_hold_their_shards(ranks, ckpt, layout):
    """load_model read only this rank's slices: the vocabulary split tp ways, heads tp ways, and
    each EP group's routed experts (tp / ep ranks per group) a contiguous n_routed_experts / ep."""
    tp, ep, _ = layout
    cfg = ModelConfig.from_file(ckpt)
    E, per = cfg.n_routed_experts, cfg.n_routed_experts // ep
    for rank in range(WORLD):
        got = ranks[layout, rank]
        assert got["lm_head"] == (cfg.vocab_size // tp, cfg.hidden_size)
        assert got["embed"] == (cfg.vocab_size // tp, cfg.hidden_size)
        assert got["heads"] == cfg.num_attention_heads // tp
        group = rank // (tp // ep)
        assert got["experts"] and all(e == list(range(group * per, (group + 1) * per)) for e in got["experts"]), \
            f"rank {rank} of {layout_id(layout)} holds experts {got['experts']} of {E}"


# --- the MTP block without its SP re-gather (the fault switch) ---------------------------------
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[2]], ids=layout_id)
@pytest.mark.parametrize("T", [1, 3, 19])
def test_skipped_gather_returns_shard_rows_and_contract_refuses(ranks, reference, layout, T):
    from services.bridge.rows import ContractError, expect_rows
    tp = layout[0]
    S = math.ceil(T / tp)                                       # ceil(T_pad / tp) rows per rank
    full_ref = torch.as_tensor(reference["faults"][T][0])       # tp = 1 (nothing to skip)
    for rank in range(WORLD):
        full, shard = (torch.as_tensor(a) for a in ranks[layout, rank]["faults"][T])
        assert rel_err(full, full_ref) < REL_TOL, f"rank {rank}: MTP output with its re-gather differs"
        assert shard.shape[0] == S, f"rank {rank}: {shard.shape[0]} rows with the gather skipped, T={T}"
        start, stop = rank * S, min((rank + 1) * S, T)          # the global rows this shard holds
        if stop > start:
            assert rel_err(shard[: stop - start], full_ref[start:stop]) < REL_TOL, f"rank {rank}: shard rows"
        if S == T:                                              # T = 1: rank 0's shard is the row itself
            assert expect_rows(shard, T, "the MTP block") is shard
            continue
        with pytest.raises(ContractError) as e:
            expect_rows(shard, T, "the MTP block")
        assert e.value.code == "INVALID_ARGUMENT"
        assert f"returned {S} rows for {T} input tokens" in str(e.value), str(e.value)


# --- row helpers in one process ----------------------------------------------------------------
@pytest.mark.parametrize("T", [0, 1, 2, 3, 4, 19])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pad_shard_trim_round_trip(T, tp):
    """Single process: the shards of every rank, concatenated and trimmed, are the T rows again."""
    x = torch.randn(T, 6, generator=torch.Generator().manual_seed(T))
    padded = pad_rows(x, tp)
    assert padded.shape[0] == math.ceil(T / tp) * tp and torch.equal(padded[:T], x) and not padded[T:].any()
    shards = [shard_rows(padded, tp, r) for r in range(tp)]
    assert {s.shape[0] for s in shards} == {math.ceil(T / tp)}
    assert torch.equal(torch.cat(shards)[:T], x)
    if tp == 1:                     # one rank: the collectives are the identity
        assert all_gather_rows(x, None, 1) is x and reduce_scatter_rows(x, None, 1) is x


def test_row_collectives_round_trip_across_ranks(ranks):
    """check_row_collectives ran on both ranks before the layouts (a failure is reported by the
    `ranks` fixture with the rank's traceback); here: every layout came back from both ranks."""
    assert sorted(ranks) == sorted((lay, r) for lay in LAYOUTS for r in range(WORLD))


# --- layout errors at build --------------------------------------------------------------------
@pytest.mark.parametrize("cls", [TargetModel, DraftModel])
def test_experts_not_divisible_by_ep(cls):
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "n_routed_experts": 7, "n_group": 1, "topk_group": 1})
    with pytest.raises(ValueError) as e:
        build(cls, cfg, ParallelState(tp_rank=0, tp_size=2, ep_size=2))
    assert "n_routed_experts (7)" in str(e.value) and "ep (2)" in str(e.value), str(e.value)
    build(cls, cfg, ParallelState(tp_rank=0, tp_size=2, ep_size=1))          # ep = 1 holds all 7


@pytest.mark.parametrize("cls", [TargetModel, DraftModel])
def test_heads_not_divisible_by_tp(cls):
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "num_attention_heads": 3})
    with pytest.raises(ValueError) as e:
        build(cls, cfg, ParallelState(tp_rank=1, tp_size=2))
    assert "num_attention_heads (3)" in str(e.value) and "tp=2" in str(e.value), str(e.value)
    build(cls, cfg, SINGLE)
