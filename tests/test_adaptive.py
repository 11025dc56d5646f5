"""The adaptive speculation policy (gateway/adaptive.py) and its cost model (gateway/spec_costs.py), driven
by a simulated batch: real GenRequest and DraftState objects, the policy's plan / observe hooks called as
the scheduler calls them, acceptance drawn from per-position profiles and phase times from a cost function.
Also the flags' validation."""
import random

import pytest

from gateway.adaptive import SYNC_PROBE, AdaptivePolicy, FixedPolicy, best_path
from gateway.request import GenRequest
from gateway import spec_costs
from gateway.spec_costs import CostModel
from tandem.v1 import rows_pb2

CHEAP = dict(v0=0.006, vb=0.0003, ve=0.0001, p0=0.0005, p1=1e-6, p2=0.0002, p3=1e-5)      # verify and drafts cheap
DEAR = dict(v0=0.004, vb=0.0014, ve=0.0013, p0=0.0015, p1=3e-4, p2=0.0034, p3=1e-4)       # a CPU: a draft step ~ half a verify


def request(i: int, k: int, temperature: float = 0.0) -> GenRequest:
    r = GenRequest(id=f"r{i}", prompt_ids=list(range(3, 35)), max_tokens=1 << 20,
                   sampling=rows_pb2.SamplingParams(temperature=temperature), text=None, k=k)
    r.draft.prefilled(list(range(3, 36)), None, speculate=True, wants_drafts=True)
    return r


def simulate(policy, reqs, profiles, cost, rounds, seed=0, resync_s=2e-4):
    """-> per round {request id: k drafted}. Stale requests are re-synced first, as Scheduler.step does
    (resync_s a committed token)."""
    rng, log = random.Random(seed), []
    for _ in range(rounds):
        for r in reqs:
            if r.draft.stale:
                n = len(r.prompt_ids) + len(r.output_ids)
                policy.resynced(n, resync_s * n)
                r.draft.resynced(list(r.prompt_ids) + list(r.output_ids), None)
        spec = policy.plan(reqs)
        ks = {r.id: r.round_k() for r in spec}
        policy.record([ks.get(r.id, 0) for r in reqs])
        rows0, m, batch = sum(len(r.draft.pending) for r in spec), sum(ks.values()), len(reqs)
        split = {"verify": cost["v0"] + cost["vb"] * batch + cost["ve"] * m, "gateway": 1e-4,
                 "propose": cost["p0"] + cost["p1"] * rows0 + cost["p2"] * max(ks.values(), default=0)
                 + cost["p3"] * m if spec else 0.0}
        for r in reqs:
            k, a, prof = ks.get(r.id, 0), 0, profiles[r.id]
            while a < k and rng.random() < prof[min(a, len(prof) - 1)]:
                a += 1
            r.stats.add(k, a)
            if r in spec:
                r.draft.proposed()
            r.output_ids += [5] * (a + 1)
            r.draft.verified([5] * (a + 1), None)
        policy.observe(reqs, split)
        log.append(ks)
    return log


def mean_k(log, ids, start):
    rounds = log[start:]
    return sum(d.get(i, 0) for d in rounds for i in ids) / (len(rounds) * len(ids))


def test_failing_drafts_drop_to_zero_park_and_are_reprobed():
    policy = AdaptivePolicy(4, reprobe_rounds=10)
    reqs = [request(i, 4) for i in range(4)]
    log = simulate(policy, reqs, {r.id: [0.0] for r in reqs}, CHEAP, 120)
    assert mean_k(log, [r.id for r in reqs], 40) < 0.1
    assert sum(1 for d in log[40:] if d) <= 12, "rounds with a Propose after the requests were parked"
    assert policy.parks >= 4 and policy.wakes >= 6
    # each wake: re-synced, then one round with exactly one draft for that request, then parked again
    probes = [d for d in log[40:] if d]
    assert probes and all(sorted(d.values()) == [1] for d in probes), probes
    assert all(not r.draft.speculate and r.draft.parked or r.draft.stale for r in reqs)
    assert all(policy.estimate(r)[0] < 0.3 for r in reqs)


def test_a_resync_the_budget_does_not_pay_for_stays_parked():
    """The default re-probe interval: a parked request whose re-sync costs more than PROBE_BUDGET of MAX_REPROBE
    rounds (a long context on a slow machine: every stream stalls while it runs) is not woken once that cost is
    known; a short one keeps being re-probed."""
    policy = AdaptivePolicy(4)
    short, long = request(0, 4), request(1, 4)
    long.prompt_ids = list(range(3, 3 + 100_000))
    long.draft.prefilled(long.prompt_ids + [3], None, speculate=True, wants_drafts=True)
    wakes = {}
    for r in (short, long):
        wake = r.draft.wake
        r.draft.wake = lambda wake=wake, rid=r.id: (wakes.__setitem__(rid, wakes.get(rid, 0) + 1), wake())
    simulate(policy, [short, long], {"r0": [0.0], "r1": [0.0]}, CHEAP, 1500, resync_s=5e-6)
    assert wakes.get("r1", 0) <= 1 and wakes.get("r0", 0) >= 4, wakes      # (the first, before any re-sync cost)


def test_high_acceptance_and_cheap_verify_draft_deep_dear_drafts_do_not():
    ids = [f"r{i}" for i in range(8)]
    cheap = simulate(AdaptivePolicy(4), [request(i, 4) for i in range(8)], {i: [0.95] for i in ids}, CHEAP, 80)
    assert mean_k(cheap, ids, 20) > 3.5
    dear = simulate(AdaptivePolicy(4), [request(i, 4) for i in range(8)], {i: [0.95] for i in ids}, DEAR, 80)
    assert mean_k(dear, ids, 20) < 0.5
    low = simulate(AdaptivePolicy(4), [request(i, 4) for i in range(8)], {i: [0.5] for i in ids}, CHEAP, 80)
    assert 0.5 < mean_k(low, ids, 20) < mean_k(cheap, ids, 20) - 1


def test_requests_that_accept_more_draft_more():
    reqs = [request(i, 4, temperature=float(i % 2)) for i in range(8)]
    profiles = {r.id: [0.95] if i % 2 == 0 else [0.15] for i, r in enumerate(reqs)}
    log = simulate(AdaptivePolicy(4), reqs, profiles, CHEAP, 100)
    good, bad = [r.id for r in reqs[0::2]], [r.id for r in reqs[1::2]]
    assert mean_k(log, good, 30) > 3 and mean_k(log, bad, 30) < 1.5
    # k = 0 beside drafting requests: still synced, probed with one draft every SYNC_PROBE rounds at least
    for rid in bad:
        idle = 0
        for d in log[30:]:
            idle = idle + 1 if d.get(rid, 0) == 0 else 0
            assert idle <= SYNC_PROBE + 1, rid


def test_per_request_caps_hold():
    reqs = [request(0, 1), request(1, 2), request(2, 4), request(3, 0)]
    reqs[3].draft.prefilled([1, 2], None, speculate=False, wants_drafts=False)     # asked for 0 drafts
    log = simulate(AdaptivePolicy(4), reqs, {r.id: [1.0] for r in reqs}, CHEAP, 40)
    for r in reqs:
        assert max(d.get(r.id, 0) for d in log) == r.k, r.id
    assert "r3" not in {i for d in log for i in d}


def test_fixed_policy_keeps_each_request_at_its_k():
    reqs = [request(0, 3), request(1, 1)]
    policy = FixedPolicy(3)
    log = simulate(policy, reqs, {r.id: [0.0] for r in reqs}, DEAR, 20)
    assert all(d == {"r0": 3, "r1": 1} for d in log) and policy.parks == 0
    assert policy.k_counts == [0, 20, 0, 20]


def test_best_path_pays_a_fixed_cost_only_when_enough_gain_follows():
    costs = CostModel()
    for _ in range(3):
        for t in (8, 16, 24, 32):
            costs.observe_round(8, t, {"verify": 0.010 + 0.0001 * t}, None)
        for steps, m in ((3, 24), (1, 8), (2, 16)):
            costs.observe_round(8, 8 + m, {"propose": 0.005 + 0.001 * steps}, (8, steps, m))
    assert costs.verify_s(8, 24) == pytest.approx(0.0124, rel=0.02)
    assert costs.verify_s(8, 12) == pytest.approx(0.0112, rel=0.02)          # not measured: the line
    assert costs.propose_s(8, 3, 24) == pytest.approx(0.008, rel=0.05)
    # one tempting draft alone does not pay for a Propose; eight of them do
    assert best_path([[0.9]] + [[0.0]] * 7, [0] * 8, 8, 8, costs) == [0] * 8
    assert best_path([[0.9]] * 8, [0] * 8, 8, 8, costs) == [1] * 8
    # equal requests get equal k; a forced probe is kept
    assert best_path([[0.9, 0.8, 0.1]] * 8, [0] * 7 + [1], 8, 8, costs) == [2] * 8
    assert best_path([[0.01]] * 8, [1] + [0] * 7, 8, 8, costs) == [1] + [0] * 7


def test_a_shape_costs_the_median_of_its_rounds():
    """One slow round (a first call) moves neither its shape's cost nor the line through the others; a
    catch-up Propose (a new request's prompt) is kept out of the round's price."""
    costs = CostModel()
    for i, y in enumerate((0.200, 0.0081, 0.0079, 0.0080)):
        costs.observe_round(1, 4, {"verify": y}, None)
        costs.observe_round(1, 1, {"verify": 0.2 if i == 0 else 0.006}, None)
    assert costs.verify_s(1, 4) == pytest.approx(0.0080, rel=0.02)
    assert costs.verify_s(1, 2) == pytest.approx(0.0067, rel=0.05)
    for y in (0.0045, 0.0044, 0.0046):
        costs.observe_round(1, 4, {"propose": y}, (2, 3, 3))
    costs.observe_round(1, 4, {"propose": 0.0045 + 65 * 2e-5}, (65, 3, 3))
    assert costs.propose_s(1, 3, 3) == pytest.approx(0.0045, rel=0.02)
    assert costs.probe_s(100) == pytest.approx(100 * 2e-5 + costs.propose_s(1, 1, 1), rel=0.05)


def test_a_round_price_is_reused_for_a_few_rounds_then_read_again():
    """CostModel.pricer keeps each priced (drafts, steps) for PRICE_ROUNDS rounds, then reads the tables anew."""
    from gateway.spec_costs import PRICE_ROUNDS
    costs = CostModel()
    for _ in range(3):
        for t in (8, 16):
            costs.observe_round(8, t, {"verify": 0.001 * t, "gateway": 0.0}, None)
    before = costs.pricer(8)(8, 1)
    assert before == pytest.approx(0.016, rel=0.02)
    for _ in range(3):                                      # the shape got twice as dear
        costs.observe_round(8, 16, {"verify": 0.032, "gateway": 0.0}, None)
    assert costs.pricer(8)(8, 1) == before                  # within PRICE_ROUNDS: the price kept
    for _ in range(PRICE_ROUNDS):
        costs.observe_round(8, 8, {"verify": 0.008, "gateway": 0.0}, None)
    assert costs.pricer(8)(8, 1) == pytest.approx(0.032, rel=0.02)


@pytest.mark.parametrize("args, message", [
    (["--speculation", "sometimes"], "--speculation must be one of ['fixed', 'adaptive'], got 'sometimes'"),
    (["--adaptive-reprobe-rounds", "-2"], "--adaptive-reprobe-rounds must be >= 0 (0: automatic), got -2"),
    (["-k", "17", "--speculation", "adaptive"], "--num-speculative-tokens must be in [0, 16], got 17")])
def test_flags_are_checked_by_name(args, message):
    from gateway.config import parse
    with pytest.raises(SystemExit) as e:
        parse(["--random-config", "tiny"] + args)
    assert str(e.value) == message
    assert parse(["--random-config", "tiny", "--speculation", "adaptive", "-k", "4"]).speculation == "adaptive"


def test_a_drafting_rounds_extra_gateway_share_is_priced_with_its_propose():
    """On a 2-core CPU a drafting round's gateway share (its commit beside the draft's work) was 1-7 ms against
    0.1 ms for a plain round; one moving average over both, mostly plain rounds, priced drafts 3+ ms too cheap.
    The excess is the Propose's: plain rounds keep the plain share, drafting shapes carry their own."""
    costs = CostModel()
    for i in range(40):
        costs.observe_round(1, 1, {"verify": 0.006, "gateway": 0.0001, "propose": 0.0}, None)
        costs.observe_round(1, 2, {"verify": 0.007, "gateway": 0.003, "propose": 0.001}, (2, 1, 1))
    assert costs.gateway == pytest.approx(0.0001, rel=0.05)
    assert costs.propose_s(1, 1, 1) == pytest.approx(0.001 + 0.003 - 0.0001, rel=0.05)
    price = costs.pricer(1)
    assert price(0, 0) == pytest.approx(0.0061, rel=0.05) and price(1, 1) == pytest.approx(0.011, rel=0.05)


def test_a_median_not_renewed_is_read_off_the_line():
    """A drafting shape not measured for FRESH rounds is priced off the line through the shapes measured since,
    not by its stale median; measured again, its own median."""
    from gateway.spec_costs import FRESH
    costs = CostModel()
    for _ in range(3):
        costs.observe_round(8, 12, {"verify": 0.050}, None)
    assert costs.verify_s(8, 12) == pytest.approx(0.050)
    for i in range(FRESH + 1):
        t = (16, 24)[i % 2]
        costs.observe_round(8, t, {"verify": 0.030 + 0.0025 * (t - 8)}, None)
    assert costs.verify_s(8, 12) < 0.045                     # the line (the old point fades), not 50 ms
    for _ in range(3):
        costs.observe_round(8, 12, {"verify": 0.041}, None)
    assert costs.verify_s(8, 12) == pytest.approx(0.041)     # measured again: its own median


def test_a_plain_round_is_priced_by_plain_rounds_only():
    """On a 2-core CPU a verify of one token per request cost 12-16 ms where the line through 2-4 tokens met
    19 ms at one token, so drafting looked cheaper than it was (batch 32 drafted k ~ 3 at 0.67-0.75x of K = 0
    in the CPU replay with 20x slow first calls). The plain shape is priced by its own median at any age (the policy measures it again),
    and an unmeasured batch of its bucket by the nearest plain shape, moved along the line's slopes."""
    from gateway.spec_costs import FRESH
    costs = CostModel()
    for _ in range(3):
        costs.observe_round(8, 8, {"verify": 0.030}, None)
        for t in (16, 24):
            costs.observe_round(8, t, {"verify": 0.040 + 0.001 * (t - 8)}, None)
    assert costs.verify_s(8, 8) == pytest.approx(0.030) and costs.pricer(8)(0, 0) == pytest.approx(0.030)
    assert spec_costs.at(costs.verify[3].coef, (8, 8)) > 0.031                # where the line would have put it
    for _ in range(FRESH + 1):
        costs.observe_round(8, 16, {"verify": 0.048}, None)
    assert costs.verify_s(8, 8) == pytest.approx(0.030)                    # stale, still its own measurement
    assert costs.plain_age(8) == FRESH + 3 and costs.plain_age(20) is None
    for _ in range(3):
        costs.observe_round(8, 8, {"verify": 0.020}, None)
    assert costs.verify_s(8, 8) == pytest.approx(0.020)
    slope = sum(costs.verify[3].coef[1:])
    assert costs.verify_s(7, 7) == pytest.approx(0.020 - slope) and slope > 0


def test_a_bucket_that_always_drafts_prices_k0_again_without_parking():
    """Every PLAIN_EVERY rounds of drafting, PLAIN_RUN rounds of k = 0 that still go to the draft."""
    from gateway.adaptive import PLAIN_EVERY, PLAIN_RUN
    policy, reqs = AdaptivePolicy(4), [request(i, 4) for i in range(8)]
    log = simulate(policy, reqs, {r.id: [0.95] for r in reqs}, CHEAP, 2 * PLAIN_EVERY + 40)
    plain = [i for i, d in enumerate(log) if i >= 20 and d and not any(d.values())]
    assert len(plain) == 2 * PLAIN_RUN, plain
    assert plain[PLAIN_RUN] - plain[0] >= PLAIN_EVERY and plain[PLAIN_RUN - 1] - plain[0] == PLAIN_RUN - 1
    assert policy.parks == 0 and all(r.draft.speculate for r in reqs)
    assert mean_k(log, [r.id for r in reqs], 20) > 3.5


def test_a_shape_far_over_the_line_stays_out_of_it():
    """A shape whose rounds were mostly first calls (20x) would lift the line that prices unmeasured shapes;
    more than OUTLIER times the line, it is left out of the fit."""
    costs = CostModel()
    for _ in range(3):
        for t in (32, 64, 96):
            costs.observe_round(32, t, {"verify": 0.010 + 0.0001 * t}, None)
        costs.observe_round(32, 128, {"verify": 0.2}, None)         # first calls in most of its rounds
    assert costs.verify_s(32, 80) == pytest.approx(0.018, rel=0.02)
    assert costs.verify_s(32, 128) == pytest.approx(0.2)            # its own median, where measured
