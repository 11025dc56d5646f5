"""`tandem bench gateway`: the gateway's own host work a round, with services that answer at once.

The gateway's Scheduler (gateway/scheduler.py) with its metrics and the checkpoint's tokenizer runs rounds
against a target and a draft that do no work: Verify accepts each draft with probability P (conditional, per
position when a profile is given) and emits the next tokens of held-out text, so detokenizing and the stop
string check see real code; Propose drafts k tokens. What one round then takes is the gateway's part alone:
planning, building and reading the messages, committing (detokenize, stop strings, events), metrics. It is
paid every round on the critical path (with overlapped rounds, its commit only where the draft is faster).

    tandem bench gateway --batches 1,8,32 --output-tokens 128,1024
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from tokenizers import Tokenizer

from gateway.metrics import GatewayMetrics
from gateway.request import GenRequest
from gateway.scheduler import Scheduler
from gateway.text import TextStream
from infra.paths import default_model_dir
from tandem.v1 import common_pb2, draft_pb2, rows_pb2, target_pb2


class InstantTarget:
    """Answers at once: drafts accepted with the profile's probabilities, tokens from `text` in turn."""

    def __init__(self, text: list[int], profile: list[float], seed: int = 0):
        self.text, self.profile, self.rng = text, profile, random.Random(seed)
        self.at: dict[str, int] = {}

    def _next(self, rid: str, n: int) -> list[int]:
        i = self.at.get(rid, hash(rid) % len(self.text))
        self.at[rid] = i + n
        return [self.text[(i + j) % len(self.text)] for j in range(n)]

    async def Prefill(self, req, timeout=None):
        ids = [it.request_id for it in req.items]
        return target_pb2.PrefillResponse(first_token_ids=[self._next(r, 1)[0] for r in ids], hidden_rows=rows(
            ids, [len(it.prompt_token_ids) for it in req.items]), num_computed_tokens=[
            len(it.prompt_token_ids) for it in req.items], num_cached_tokens=[0] * len(ids))

    async def Verify(self, req, timeout=None):
        results = []
        for it in req.items:
            a = 0
            while a < len(it.draft_token_ids) and self.rng.random() < self.profile[min(a, len(self.profile) - 1)]:
                a += 1
            results.append(target_pb2.VerifyResult(num_accepted=a, emitted_token_ids=self._next(it.request_id, a + 1)))
        return target_pb2.VerifyResponse(results=results, hidden_rows=rows(
            [it.request_id for it in req.items], [r.num_accepted + 1 for r in results]))

    async def Release(self, req, timeout=None):
        return common_pb2.ReleaseResponse()


class InstantDraft(InstantTarget):
    async def Propose(self, req, timeout=None):
        return draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(
            draft_token_ids=[1] * it.num_draft_tokens) for it in req.items])


def rows(ids: list[str], counts: list[int]) -> rows_pb2.HiddenRows:
    return rows_pb2.HiddenRows(request_ids=ids, rows_per_request=counts, num_rows=sum(counts), hidden_size=1,
                               transport=rows_pb2.TRANSPORT_BRIDGE, layout=rows_pb2.ROW_LAYOUT_FULL)


async def measure(tok: Tokenizer, text: list[int], batch: int, output: int, k: int, profile: list[float],
                  overlap: bool) -> dict:
    """Rounds of `batch` requests from their first token to `output` tokens each -> ms a round."""
    s = Scheduler(InstantTarget(text, profile), InstantDraft(text, profile), set(), max_batch=batch,
                  observer=GatewayMetrics("bench"), overlap=overlap)
    reqs = [GenRequest(id=s.new_id(), prompt_ids=text[i:i + 64], max_tokens=output, ignore_eos=True, k=k,
                       sampling=rows_pb2.SamplingParams(), text=TextStream(tok, ["\n\n\n\n"])) for i in range(batch)]
    for r in reqs:
        s.submit(r)
    await s.step()                                     # the Prefill and a first round
    rounds, t0 = 0, time.perf_counter()
    while s.running:
        await s.step()
        rounds += 1
        for r in reqs:                                 # the front end's part: take the events
            while not r.events.empty():
                r.events.get_nowait()
    wall = time.perf_counter() - t0
    return {"batch": batch, "output_tokens": output, "k": k, "overlap": overlap, "rounds": rounds,
            "ms_per_round": 1e3 * wall / max(rounds, 1), "us_per_token": 1e6 * wall / (batch * output)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory for its tokenizer (default: the bundled model)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--output-tokens", default="128,1024", help="tokens each request generates")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--acceptance", default="0.92,0.72,0.36", help="P, or P1,P2,.. conditional per position")
    p.add_argument("--repeats", type=int, default=3, help="the best of this many runs is reported")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    a = p.parse_args(argv)
    model = Path(a.model) if a.model else default_model_dir()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    corpus = sorted((Path(__file__).resolve().parent.parent / "gateway").glob("*.py"))
    text = tok.encode("\n".join(f.read_text() for f in corpus)).ids          # real code, ~50k tokens
    profile = [float(x) for x in a.acceptance.split(",")]
    rows_out = []
    for b in (int(x) for x in a.batches.split(",")):
        for n in (int(x) for x in a.output_tokens.split(",")):
            best = min((asyncio.run(measure(tok, text, b, n, a.k, profile, True)) for _ in range(a.repeats)),
                       key=lambda r: r["ms_per_round"])
            rows_out.append(best)
            print(f"batch {b:3d}  {n:5d} tokens each: {best['ms_per_round']:7.3f} ms a round, "
                  f"{best['us_per_token']:6.1f} us a token ({best['rounds']} rounds)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows_out, indent=1))
    return 0
