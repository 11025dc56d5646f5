"""RecomputeRows in process: the target rebuilds a lost draft's input (the hidden rows of every
committed position but the last) without touching the request's own cache, and a fresh draft
given the request as new (position 0, every committed token) goes on proposing: greedy output
still equals plain target decoding. A token list that is not the request's committed one is
refused, naming both counts."""
import pytest
import torch

from models.runner import greedy_generate, new_cache
from infra.errors import ServiceError
from services.draft.engine import DraftEngine, ProposeItem
from services.sampling import Sampling
from test_engines import engines, make_models

PROMPT = [5, 9, 13, 17, 21, 3]


def rounds(te, de, tokens: list[int], pending: list[int], rows: torch.Tensor, position: int, n: int):
    """n Propose -> Verify rounds of request "r"; appends to tokens -> (pending, rows, position, all rows)."""
    kept = []
    for _ in range(n):
        (d, q), = de.propose([ProposeItem("r", pending, 3, Sampling(), position)], {"r": rows})
        position += len(pending)
        _, emitted, rows, *_ = te.verify([("r", d, q)])
        kept.append(rows)
        pending = emitted[0]
        tokens += pending
    return pending, rows, position, kept


def test_recompute_rows_rebuilds_a_lost_draft():
    target, draft = make_models(head_std=0.5)
    te, de = engines(target, draft)
    first, hidden, *_ = te.prefill([("r", PROMPT, Sampling())])
    tokens = PROMPT + first
    pending, rows, position, kept = rounds(te, de, tokens, list(tokens), hidden, 0, 5)
    free, length = te.cache.num_free_blocks, te.cache.length("r")

    again = te.recompute_rows([("r", list(tokens))])
    assert te.cache.num_free_blocks == free and te.cache.length("r") == length     # own cache untouched
    before = torch.cat([hidden] + kept)[: len(tokens) - 1]                          # rows the draft had been given
    assert again.shape == before.shape == (len(tokens) - 1, target.cfg.hidden_size)
    torch.testing.assert_close(again, before, atol=1e-4, rtol=1e-4)

    fresh = DraftEngine(draft, new_cache(draft, 512), 2048)                       # the restarted draft
    (d_old, _), = de.propose([ProposeItem("r", pending, 3, Sampling(), position)], {"r": rows})
    (d_new, q), = fresh.propose([ProposeItem("r", list(tokens), 3, Sampling(), 0)], {"r": again})
    assert d_new == d_old                            # re-synced, it proposes what the old draft would have
    _, emitted, rows, *_ = te.verify([("r", d_new, q)])
    tokens += emitted[0]
    pending, *_ = rounds(te, fresh, tokens, emitted[0], rows, len(tokens) - len(emitted[0]), 4)
    n = len(tokens) - len(PROMPT)
    assert tokens[len(PROMPT):] == greedy_generate(target, PROMPT, n)
    assert fresh.committed["r"] == len(tokens) - len(pending) - 1               # in step with the target


def test_recompute_rows_refuses_other_tokens():
    target, draft = make_models()
    te, _ = engines(target, draft)
    first, *_ = te.prefill([("r", PROMPT, Sampling())])
    with pytest.raises(ServiceError) as e:
        te.recompute_rows([("r", PROMPT)])                                        # the first token missing
    assert e.value.code == "FAILED_PRECONDITION" and f"{len(PROMPT)} tokens" in str(e.value) \
        and f"holds {len(PROMPT) + 1}" in str(e.value)
    with pytest.raises(ServiceError) as e:
        te.recompute_rows([("gone", PROMPT + first)])
    assert e.value.code == "FAILED_PRECONDITION"
    assert te.cache.request_ids() == ["r"]                                        # no scratch entry left
