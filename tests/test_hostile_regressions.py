"""What the hostile-input fuzzers (test_fuzz_services.py) found in the services, pinned: each case
with the status and message it gets now (and, in a comment, what it did before)."""
from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from fuzz_cluster import BRIDGE, HIDDEN, LIVE, PROMPT, SERVICE_MAX_BYTES, TIMEOUT, prefill_live
from tandem.v1 import draft_pb2, rows_pb2, target_pb2

pytestmark = pytest.mark.slow


def status_of(fn, req) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn(req, timeout=TIMEOUT)
    return e.value.code(), e.value.details()


def test_regressions(fuzz_cluster):
    c, bad = fuzz_cluster, grpc.StatusCode.INVALID_ARGUMENT
    try:
        for t in (math.nan, math.inf):          # non-finite temperature: refused by both services
            code, msg = status_of(c.target.Prefill, target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
                request_id="fz-t", prompt_token_ids=PROMPT, sampling=rows_pb2.SamplingParams(temperature=t))]))
            assert code == bad and "sampling.temperature" in msg, msg
        greedy_first = prefill_live(c, rows_pb2.SamplingParams()).first_token_ids
        c.release([LIVE])
        tiny_t = prefill_live(c, rows_pb2.SamplingParams(temperature=1e-45)).first_token_ids
        assert tiny_t == greedy_first, "temperature 1e-45 sampled from NaN (always token 0); it is greedy now"
        c.release([LIVE])
        resp = prefill_live(c, rows_pb2.SamplingParams())
        first = PROMPT + list(resp.first_token_ids)

        def propose(rows, k=2, s=None, position=0):
            return c.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id=LIVE, new_token_ids=first, num_draft_tokens=k, sampling=s, position=position)],
                hidden_rows=[rows]), timeout=TIMEOUT)

        def refused(rows, k=2, s=None, position=0):
            with pytest.raises(grpc.RpcError) as e:
                propose(rows, k, s, position)
            return e.value.code(), e.value.details()
        poisoned = rows_pb2.HiddenRows()
        poisoned.CopyFrom(resp.hidden_rows)
        data = np.frombuffer(poisoned.inline_data, dtype="<f4").copy()
        data[HIDDEN + 3] = math.nan                                 # row 1
        poisoned.inline_data = data.tobytes()
        assert refused(poisoned) == (bad, "hidden rows contract: hidden_rows[0].inline_data holds non-finite values "
                                          "(NaN or inf) in 1 of 5 rows, first at row 1")
        assert "sampling.temperature" in refused(resp.hidden_rows, s=rows_pb2.SamplingParams(temperature=math.nan))[1]
        code, msg = refused(resp.hidden_rows, k=17)
        assert code == bad and "--max-draft-tokens" in msg, msg
        wrong = rows_pb2.HiddenRows()
        wrong.CopyFrom(resp.hidden_rows)
        wrong.dtype = 99                                            # was a ValueError naming the enum: UNKNOWN
        code, msg = refused(wrong)
        assert code == bad and "dtype is 99 (not a DType)" in msg, msg
        wrong.dtype, wrong.transport, wrong.transfer_id = rows_pb2.DTYPE_FLOAT32, BRIDGE, 2**63
        code, msg = refused(wrong)                                  # was UNAVAILABLE: the gateway's "draft down"
        assert code == grpc.StatusCode.NOT_FOUND and "not held by the target" in msg, msg
        twice = rows_pb2.HiddenRows()
        twice.CopyFrom(resp.hidden_rows)
        twice.request_ids.append(LIVE)
        twice.rows_per_request.append(0)
        assert "names a request twice" in refused(twice)[1]
        # seed 2**64 - 1 with sampling: the draft's seed + 1 overflowed torch's manual_seed (UNKNOWN)
        out = propose(resp.hidden_rows, s=rows_pb2.SamplingParams(temperature=1.0, seed=2**64 - 1))
        assert len(out.results[0].draft_token_ids) == 2
        code, msg = status_of(c.target.Verify, target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            request_id=LIVE, draft_token_ids=list(out.results[0].draft_token_ids), logprobs=21)]))
        assert code == bad and "--max-logprobs" in msg, msg
        code, msg = status_of(c.target.Prefill, target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
            request_id="fz-big", prompt_token_ids=[7] * (SERVICE_MAX_BYTES + 10))]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, msg      # the service's --max-message-bytes
    finally:
        c.release({LIVE, "fz-t", "fz-big"})
