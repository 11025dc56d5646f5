"""The CPU's attention (kernels/mla.py, the PyTorch reference) pads requests to a common query length by groups
(models/batch.py AttentionBatch.reference_groups): a decode or verify row that shares a step with a prompt chunk is
not padded to the chunk's length (which made an 800-token prompt riding a Verify of six requests cost 52 s instead
of 1.8 on this CPU), and every request's rows equal the same request computed alone."""
import dataclasses

import torch

from kernels.mla import latent_attention
from models.kv_cache import PagedKVCache

H, R, P, BS = 4, 32, 16, 8


def step(grow: dict[str, int], history: list[dict[str, int]], seed: int = 0):
    """A cache with random contents, requests grown by `history`, then the step `grow` -> (cache, its batch, q_lat,
    q_pe)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 128, BS, R, P, dtype=torch.float32, device="cpu")
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    for s in [*history, grow]:
        for r in s:
            if r not in cache:
                cache.allocate(r)
        batch = cache.prepare(list(s), list(s.values()))
    n = batch.num_tokens
    return cache, batch, torch.randn(n, H, R, generator=g), torch.randn(n, H, P, generator=g)


HISTORY = [{"dec": 30, "ver": 12, "dec2": 3}]
MIXED = {"dec": 1, "ver": 4, "dec2": 1, "chunk": 200, "small": 20}          # decode, verify, two prompt chunks


def test_decode_rows_are_not_padded_to_a_prompt_chunk():
    _, batch, _, _ = step(MIXED, HISTORY)
    tmax = sorted(mask.shape[1] for _, _, _, mask in batch.reference_groups())
    assert tmax == [4, 20, 200], tmax                 # decode + verify rows; the 20-token chunk; the 200-token one
    _, alone, _, _ = step({"dec": 1, "ver": 4}, HISTORY)
    assert len(alone.reference_groups()) == 1 and alone.reference_groups()[0][0] is None   # one group: as before


def test_each_request_equals_itself_computed_alone():
    cache, batch, ql, qp = step(MIXED, HISTORY)
    out = latent_attention(ql, qp, batch, cache.ckv[0], cache.kpe[0], 0.2)
    start = 0
    for b, (r, n) in enumerate(MIXED.items()):
        alone = dataclasses.replace(batch, positions=batch.positions[start:start + n], query_lens=[n], request_ids=[r],
                                    host_block_tables=batch.host_block_tables[b:b + 1],
                                    host_starts=[batch.host_starts[b]], plans={})
        one = latent_attention(ql[start:start + n], qp[start:start + n], alone, cache.ckv[0], cache.kpe[0], 0.2)
        torch.testing.assert_close(out[start:start + n], one, rtol=1e-6, atol=1e-6)
        start += n
