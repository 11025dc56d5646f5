"""Prometheus metrics of the gateway (vLLM-style names, `tandem:` prefix) and the periodic stats log.

Speculative decoding counters follow vLLM's definitions: acceptance rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts (the bonus token counted, at most K + 1),
per-position acceptance = accepted_per_pos[i] / drafts. They, the running/waiting gauges and the
KV-cache block gauges (GetInfo of target and draft, polled on each scrape and each log tick) are
read when scraped; latencies are histograms observed as tokens are committed.

inter_token_latency: a round commits several tokens at once; its time since the request's
previous commit is spread evenly over them (dt / n, observed n times), as a client sees it.

Speculation policy (gateway/adaptive.py): spec_decode_chosen_k is a histogram of the k each running
request got a round (0: none); spec_decode_request_acceptance{position} a histogram, over finished
requests that drafted, of each one's conditional acceptance at each draft position as the policy
estimated it (fixed: as measured); spec_decode_parked / spec_decode_reprobes count requests the
adaptive policy parked at k = 0 (no Propose) and woke again for a probe.

hidden_transport_info{transport}: 1 for the transport hidden rows take now (`hidden_transport`), the
series vLLM-style info gauges use; speculation_active: 1 while the draft proposes (0: off or degraded).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gateway.scheduler import GenRequest, Observer, SpecStats
from tandem.v1 import common_pb2, rows_pb2

log = logging.getLogger("tandem.gateway")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
ACCEPTANCE_BUCKETS = tuple(i / 10 for i in range(1, 10)) + (0.95, 1.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics(Observer):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.scheduler = None
        self.services: dict[str, object] = {}               # "target" | "draft" -> stub with GetInfo
        self.info: dict[str, common_pb2.InfoResponse | str] = {}   # last GetInfo, or the error
        lab = ["model_name"]
        r = self.registry
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Inter-token latency", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.phases = Histogram(
            "tandem:round_phase_seconds", "Per batch: prefill (RPC wall), resync (a draft re-sync's wall); per "
            "round: round (wall), propose and verify (RPC walls), gateway (round less both RPCs), transfer and "
            "draft_compute (inside propose), target_compute (inside verify), rpc_request and rpc_response (both "
            "calls' one-way hops, services on this host), rpc_service (their handlers' time around the timed work)",
            lab + ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", lab, registry=r)
        self.success = Counter("tandem:request_success", "Requests finished", lab + ["finished_reason"], registry=r)
        self.request_acceptance = Histogram(
            "tandem:spec_decode_request_acceptance", "Per finished request that drafted: its conditional acceptance "
            "at each draft position, as the speculation policy estimates it", lab + ["position"],
            buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.registry.register(_Collector(self))
        self._last = SpecStats()
        self._itl = self.itl.labels(model_name)                             # observed per token: looked up once
        self._generated = self.generation_tokens.labels(model_name)

    def attach(self, scheduler, services: dict) -> None:
        self.scheduler, self.services = scheduler, services

    # --- Observer hooks (called by the scheduler) --------------------------------------------------
    def phase(self, name: str, seconds: float) -> None:
        self.phases.labels(self.model_name, name).observe(max(0.0, seconds))

    def round_split(self, seconds: dict[str, float]) -> None:
        for name, s in seconds.items():
            self.phases.labels(self.model_name, name).observe(max(0.0, s))

    def tokens(self, r: GenRequest, n: int, now: float) -> None:
        if r.first_token_time is None:
            self.ttft.labels(self.model_name).observe(now - r.arrival)
            self.prompt_tokens.labels(self.model_name).inc(len(r.prompt_ids))
        elif n:
            gap = (now - r.last_token_time) / n
            for _ in range(n):
                self._itl.observe(gap)
        self._generated.inc(n)

    def finished(self, r: GenRequest, reason: str | None, now: float) -> None:
        """r ended: reason stop | length, or None: cancelled by its client (abort, as vLLM counts it) or failed
        (error)."""
        if reason:
            self.e2e.labels(self.model_name).observe(now - r.arrival)
        self.success.labels(self.model_name, reason or ("abort" if r.cancelled else "error")).inc()
        if self.scheduler is not None and r.stats.num_drafts:
            for i, a in enumerate(self.scheduler.policy.estimate(r)):
                self.request_acceptance.labels(self.model_name, str(i)).observe(a)

    # --- services ---------------------------------------------------------------------------------
    async def poll(self) -> dict:
        """GetInfo of every service (2 s each, concurrently) -> name -> InfoResponse or error text."""
        async def one(name, stub):
            try:
                return name, await stub.GetInfo(common_pb2.InfoRequest(), timeout=2)
            except grpc.aio.AioRpcError as e:
                return name, f"{e.code().name}: {e.details()}"
        self.info = dict(await asyncio.gather(*(one(n, s) for n, s in self.services.items())))
        return self.info

    async def render(self) -> bytes:
        await self.poll()
        return generate_latest(self.registry)

    # --- periodic log ------------------------------------------------------------------------------
    def stats_line(self) -> str | None:
        """Spec-decode stats since the last call (None when nothing happened)."""
        s = self.scheduler
        cur, last = s.stats, self._last
        drafts = cur.num_drafts - last.num_drafts
        running, waiting = len(s.running) + len(s.prefilling), len(s.waiting)
        if not drafts and not running and not waiting:
            return None
        accepted = cur.num_accepted_tokens - last.num_accepted_tokens
        tokens = cur.num_draft_tokens - last.num_draft_tokens
        per_pos = [a - (last.accepted_per_position[i] if i < len(last.accepted_per_position) else 0)
                   for i, a in enumerate(cur.accepted_per_position)]
        self._last = SpecStats(cur.num_drafts, cur.num_draft_tokens, cur.num_accepted_tokens,
                               list(cur.accepted_per_position))
        kv = " ".join(f"{n} KV blocks free {i.kv_blocks_free}/{i.kv_blocks_total};" for n, i in self.info.items()
                      if not isinstance(i, str))
        spec = (f"mean acceptance length {1 + accepted / drafts:.2f}, acceptance rate {accepted / tokens:.2f}, "
                f"per-position acceptance [{', '.join(f'{a / drafts:.2f}' for a in per_pos)}], "
                f"drafts {drafts}, draft tokens {tokens}, accepted {accepted}" if drafts else "no drafts")
        return f"running {running}, waiting {waiting}; {kv} spec decode: {spec}"

    async def log_periodically(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
                line = self.stats_line()
            except Exception:                               # stats must never stop the gateway
                log.exception("stats log failed")
                continue
            if line:
                log.info("stats (last %.0fs): %s", interval_s, line)


class _Collector:
    """Values read from the scheduler and the last GetInfo poll at scrape time."""

    def __init__(self, m: GatewayMetrics):
        self.m = m

    def collect(self):
        m, lab = self.m, [self.m.model_name]
        s = m.scheduler
        if s is None:
            return
        st = s.stats
        for name, doc, v in (
                ("spec_decode_num_drafts", "Rounds that proposed >= 1 draft token", st.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed", st.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted", st.num_accepted_tokens),
                ("spec_decode_proposals_ahead", "Rounds whose Propose the target sent the draft from the round "
                 "before's Verify (gateway/proposals.py)", s.ahead_rounds),
                ("spec_decode_proposals_early", "Of those, Proposes the target sent as the Verify's acceptance was "
                 "queued, before its host read it (services/draft/early.py)", s.early_rounds),
                ("spec_decode_joins_with_ahead", "First Proposes of joining requests the draft computed in one pass "
                 "with the round's Propose sent ahead (gateway/proposals.py join)", s.joins_ahead),
                ("num_prefills_in_verify", "Prefills (new prompts, chunks) that rode a round's Verify, one forward "
                 "(gateway/chunking.py)", s.mixed_prefills),
                ("num_late_admissions", "Requests admitted into a round's Verify while the round waited for its "
                 "drafts (--late-admission, gateway/chunking.py admit_late)", s.late_admissions)):
            c = CounterMetricFamily(f"tandem:{name}", doc, labels=["model_name"])
            c.add_metric(lab, v)
            yield c
        yield from _policy(s.policy, lab)
        c = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position", labels=["model_name", "position"])
        for i, v in enumerate(st.accepted_per_position):
            c.add_metric(lab + [str(i)], v)
        yield c
        c = CounterMetricFamily("tandem:num_preemptions", "Requests whose KV cache was taken back when it was full "
                                "(recomputed later)", labels=["model_name"])
        c.add_metric(lab, s.preemptions)
        yield c
        for name, doc, v in (("num_requests_running", "Requests in the running batch (prefilling in chunks included)",
                              len(s.running) + len(s.prefilling)),
                             ("num_requests_waiting", "Requests waiting for a Prefill", len(s.waiting))):
            g = GaugeMetricFamily(f"tandem:{name}", doc, labels=["model_name"])
            g.add_metric(lab, v)
            yield g
        used = GaugeMetricFamily("tandem:kv_cache_blocks_used", "KV cache blocks in use", labels=["model_name", "service"])
        free = GaugeMetricFamily("tandem:kv_cache_blocks_free", "KV cache blocks free", labels=["model_name", "service"])
        up = GaugeMetricFamily("tandem:service_up", "1 when the service answered GetInfo", labels=["model_name", "service"])
        for name, info in m.info.items():
            up.add_metric(lab + [name], 0 if isinstance(info, str) else 1)
            if not isinstance(info, str):
                used.add_metric(lab + [name], info.kv_blocks_total - info.kv_blocks_free)
                free.add_metric(lab + [name], info.kv_blocks_free)
        yield from (used, free, up)
        yield from _prefix_cache(m.info, lab)
        g = GaugeMetricFamily("tandem:hidden_transport_info", "1 for the transport hidden rows take now "
                              "(bridge:shm|gloo|nccl|ipc, inline, none)", labels=["model_name", "transport"])
        g.add_metric(lab + [hidden_transport(s, m.info)], 1)
        yield g
        yield from _availability(s.avail, lab)


def hidden_transport(s, info: dict) -> str:
    """How hidden rows travel now: "bridge:<shm|gloo|nccl|ipc>" while the gateway asks for the bridge and the
    target's end of it is connected (its last GetInfo), else "inline"; "none" without a draft."""
    if s.draft is None:
        return "none"
    t = info.get("target")
    if s.transport == rows_pb2.TRANSPORT_INLINE or isinstance(t, str) or t is None or not t.hidden_transport:
        return "inline"
    return f"bridge:{t.hidden_transport}"


def _policy(policy, lab: list[str]):
    """The speculation policy's counters (gateway/adaptive.py): chosen k per request-round, parks, wakes."""
    h = HistogramMetricFamily("tandem:spec_decode_chosen_k", "Draft tokens a running request got in a round "
                              "(0: none), chosen by the speculation policy", labels=["model_name"])
    counts, cum = policy.k_counts, 0
    buckets = []
    for k, n in enumerate(counts):
        cum += n
        buckets.append((str(float(k)), cum))
    h.add_metric(lab, buckets + [("+Inf", cum)], sum(k * n for k, n in enumerate(counts)))
    yield h
    for name, doc, v in (("spec_decode_parked", "Times a request was parked at k = 0 (no Propose)", policy.parks),
                         ("spec_decode_reprobes", "Parked requests woken for a probe", policy.wakes)):
        c = CounterMetricFamily(f"tandem:{name}", doc, labels=["model_name"])
        c.add_metric(lab, v)
        yield c


def _prefix_cache(info: dict, lab: list[str]):
    """vLLM's prefix-cache counters (tokens) of each service that has prefix caching on (its last GetInfo)."""
    for name, doc in (("queries", "Prompt tokens looked up in the prefix cache"),
                      ("hits", "Prompt tokens found in the prefix cache")):
        c = CounterMetricFamily(f"tandem:prefix_cache_{name}", doc, labels=["model_name", "service"])
        for service, i in info.items():
            if not isinstance(i, str) and i.prefix_caching:
                c.add_metric(lab + [service], getattr(i, f"prefix_cache_{name}"))
        yield c


def _availability(av, lab: list[str]):
    """Fault state (gateway/availability.py): degraded speculation, an unavailable target, refusals."""
    for name, doc, v in (
            ("speculation_degraded", "1 while speculation is off because the draft failed", av.degraded is not None),
            ("speculation_active", "1 while the draft proposes (0: no draft, or degraded)",
             av.has_draft and av.degraded is None),
            ("target_unavailable", "1 while the target is down and new requests are refused", av.target_down is not None)):
        g = GaugeMetricFamily(f"tandem:{name}", doc, labels=["model_name"])
        g.add_metric(lab, int(v))
        yield g
    for name, doc, v in (("draft_failures", "Times speculation became degraded", av.draft_failures),
                         ("draft_resynced_requests", "Running requests whose draft cache was rebuilt", av.resynced)):
        c = CounterMetricFamily(f"tandem:{name}", doc, labels=["model_name"])
        c.add_metric(lab, v)
        yield c
    c = CounterMetricFamily("tandem:requests_rejected", "Requests refused at admission, by reason "
                            "(queue_full: 429; target_unavailable, shutting_down: 503)", labels=["model_name", "reason"])
    for reason in ("queue_full", "target_unavailable", "shutting_down"):
        c.add_metric(lab + [reason], av.rejected[reason])
    yield c
