"""GPU end to end (issue 17): whichever attention long prefill steps take (TANDEM_PREFILL=off: the paged decode
kernels; absorbed: kernels/triton_mla_prefill.py; expanded: kernels/mla_expanded.py), the served greedy tokens
are the same and the target's first-token logprobs agree to 1e-4 (fp32): whole prompts, chunks after cached keys
(--max-num-batched-tokens 700) and a prefix hit with a long uncached tail. The steps are longer than the
CUDA-graph buckets (512 tokens), so they run eager, the path of the prefill forms; the log says which form
served them. Skipped without CUDA."""
import pytest
import torch

from gpu_cluster import serve_cuda
from tandem.v1 import common_pb2, generate_pb2, rows_pb2, target_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs CUDA; this machine has none")]


def prompts(seed: int) -> list[list[int]]:
    """650 tokens (one step), 1400 (chunks 700 + 700: the second after 700 cached keys), and the first 900 of
    those + 700 new ones (a prefix hit of 56 blocks, then chunks 700 + 4), fresh random ids per seed."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (650, 1400, 700))
    return [a, b, b[:900] + c]


def first_logprobs(target, prompt: list[int], rid: str) -> tuple[int, list[int], list[float]]:
    """The target's Prefill of `prompt` in chunks of 700 -> (positions found cached, first token's top-5 ids,
    their logprobs): values that move with any change in the attention."""
    cached = None
    while True:
        r = target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id=rid, prompt_token_ids=prompt, sampling=rows_pb2.SamplingParams(), logprobs=5,
            max_chunk_tokens=700)]), timeout=300)
        cached = r.num_cached_tokens[0] if cached is None else cached
        if r.num_computed_tokens[0] == len(prompt):
            break
    target.Release(common_pb2.ReleaseRequest(request_ids=[rid]), timeout=10)
    top = r.logprobs[0].first_token
    return cached, list(top.top_token_ids), list(top.top_logprobs)


def served(tmp, monkeypatch, mode: str):
    """(gateway greedy tokens per prompt, the target's first-token logprobs per prompt, the cluster's log)."""
    monkeypatch.setenv("TANDEM_PREFILL", mode)                    # inherited by target and draft
    with serve_cuda(tmp / mode, ["--max-num-batched-tokens", "700"]) as (gateway, target, _, log):
        outs = [list(gateway.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=p), max_tokens=16, ignore_eos=True, num_speculative_tokens=3),
            timeout=300).token_ids) for p in prompts(seed=17)]
        lps = [first_logprobs(target, p, f"lp{i}") for i, p in enumerate(prompts(seed=18))]
        return outs, lps, log.read_text()


def test_prefill_forms_serve_the_same_tokens_and_logprobs(tmp_path, monkeypatch):
    got = {mode: served(tmp_path, monkeypatch, mode) for mode in ("off", "absorbed", "expanded")}
    outs, lps, _ = got["off"]
    assert all(len(t) == 16 for t in outs) and [c for c, _, _ in lps] == [0, 0, 896]    # a prefix hit
    for mode in ("absorbed", "expanded"):
        assert got[mode][0] == outs, (mode, got[mode][0], outs)
        for (_, ids, lp), (_, ref_ids, ref_lp) in zip(got[mode][1], lps):
            assert ids == ref_ids and max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-4, (mode, lp, ref_lp)
        assert f"prefill steps: {mode} attention" in got[mode][2], got[mode][2][-3000:]   # the form served them
    assert "prefill steps: absorbed" not in got["off"][2] and "prefill steps: expanded" not in got["off"][2]
