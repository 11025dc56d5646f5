"""Requests whose gateway is gone do not hold the target's KV blocks for good (found probing as an operator: a gateway
SIGKILLed under `tandem serve` left its six in-flight requests and 85 blocks held on the target; a Release lost to a
busy target did the same). The target releases a request that no Prefill or Verify named for --request-idle-s; a
running request is named every round, so serving goes on untouched."""
from __future__ import annotations

import time

import pytest

from cluster import Cluster, make_checkpoint
from tandem.v1 import common_pb2, generate_pb2 as gen, target_pb2

pytestmark = pytest.mark.slow
IDLE_S = 3.0


def info(c):
    return c.target.GetInfo(common_pb2.InfoRequest(), timeout=10)


def test_requests_no_call_names_are_released_and_running_ones_are_not(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny", seed=4)
    with Cluster(ckpt, k=2, targets=[{"args": ["--request-idle-s", str(IDLE_S)]}], log_dir=tmp_path / "logs") as c:
        free = info(c).kv_blocks_free
        c.target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(   # a gateway that then died
            request_id="orphan", prompt_token_ids=list(range(3, 60)))]), timeout=30)
        assert (info(c).running_requests, info(c).kv_blocks_free) == (1, free - 4)
        t0 = time.monotonic()
        req = gen.GenerateRequest(max_tokens=120, ignore_eos=True)          # runs longer than IDLE_S: never idle
        req.token_ids.ids.extend([5, 6, 7])
        while time.monotonic() - t0 < IDLE_S + 2:
            r = c.gateways[0].stub.Generate(req, timeout=120)
            assert len(r.token_ids) == 120
        c.wait_drained(timeout_s=30)                          # the orphan released, as the gateway's own were
        assert info(c).kv_blocks_free == free
        assert "releasing 1 requests no call named" in (tmp_path / "logs" / "target.log").read_text()
