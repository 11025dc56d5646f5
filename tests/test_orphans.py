"""Requests whose gateway is gone do not hold the target's KV blocks for good (found probing as an operator: a gateway
SIGKILLed under `tandem serve` left its six in-flight requests and 85 blocks held on the target; a Release lost to a
busy target did the same). The target releases a request that no Prefill or Verify named for --request-idle-s; a
running request is named every round, so serving goes on untouched."""
from __future__ import annotations

import time

import pytest

from cluster import Cluster, make_checkpoint
from tandem.v1 import common_pb2, draft_pb2, generate_pb2 as gen, rows_pb2, target_pb2

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


def test_the_draft_releases_what_a_gone_gateway_held_and_keeps_a_live_ones(tmp_path):
    """Draft side: requests are held under their gateway's session (services/sessions.py). A session that calls,
    if only by GetInfo keepalives (a request parked at k = 0 gets no Propose), keeps its requests; a SIGKILLed
    gateway's are released once its session has been silent for --request-idle-s; requests proposed without a
    session (hand-made calls) are never released for idleness."""
    ckpt = make_checkpoint(tmp_path / "tiny", seed=5)
    idle = ["--request-idle-s", str(IDLE_S)]
    with Cluster(ckpt, k=2, targets=[{"args": idle}], drafts=[{"args": idle}], log_dir=tmp_path / "logs",
                 gateways=[{"name": "gateway"}, {"name": "doomed"}], hidden_transport="inline") as c:
        def hold(rid: str, session: str, first: int) -> None:   # a request's Prefill and first Propose, as sent
            prompt = list(range(first, first + 25))             # (by a gateway's round)
            pre = c.target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
                request_id=rid, prompt_token_ids=prompt)], return_hidden_rows=True,
                transport=rows_pb2.TRANSPORT_INLINE), timeout=30)
            c.draft.Propose(draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(
                request_id=rid, new_token_ids=prompt + list(pre.first_token_ids), num_draft_tokens=2)],
                hidden_rows=[pre.hidden_rows], gateway_session=session), timeout=30)
            c.target.Release(common_pb2.ReleaseRequest(request_ids=[rid]), timeout=10)    # the draft's copy only
        hold("kept", "alive", 100)
        hold("orphan", "gone", 200)
        hold("anon", "", 300)
        doomed = c.gateways[1].stub.GenerateStream(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=[7, 8, 9]), max_tokens=2000, ignore_eos=True), timeout=300)
        next(iter(doomed))
        deadline = time.monotonic() + 30
        while draft_info(c).running_requests < 4:       # its first Propose is in
            assert time.monotonic() < deadline, draft_info(c)
            time.sleep(0.1)
        c.kill("doomed")
        c.procs.remove(c.proc("doomed"))

        def serve_for(seconds: float, keepalive: bool) -> None:   # the live gateway's Proposes look for silent sessions
            t0, req = time.monotonic(), gen.GenerateRequest(max_tokens=40, ignore_eos=True)
            req.token_ids.ids.extend([5, 6, 7])
            while time.monotonic() - t0 < seconds:
                if keepalive:
                    c.draft.GetInfo(common_pb2.InfoRequest(gateway_session="alive"), timeout=10)
                assert len(c.gateways[0].stub.Generate(req, timeout=120).token_ids) == 40
        serve_for(IDLE_S + 2, keepalive=True)
        time.sleep(0.5)                                  # the live gateway's last Release
        assert draft_info(c).running_requests == 2, "the gone gateway's two requests released, 'kept' and 'anon' held"
        serve_for(IDLE_S + 2, keepalive=False)
        time.sleep(0.5)
        assert draft_info(c).running_requests == 1, "'kept' released once its session fell silent"
        c.draft.Release(common_pb2.ReleaseRequest(request_ids=["anon"]), timeout=10)
        c.wait_drained(timeout_s=30)
        lines = [x for x in (tmp_path / "logs" / "draft.log").read_text().splitlines()
                 if "requests of gateway sessions silent" in x]      # (one sweep, or two: the sessions' silences
        named = " ".join(lines)                                    # began apart)
        assert sum(int(x.split("releasing ")[1].split()[0]) for x in lines) == 3, lines
        assert "'orphan'" in named and "'kept'" in named and "'anon'" not in named, lines


def draft_info(c):
    return c.draft.GetInfo(common_pb2.InfoRequest(), timeout=10)
