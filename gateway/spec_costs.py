"""What a speculative round costs, as the adaptive policy (gateway/adaptive.py) predicts it: measured live from
the phase times the scheduler takes each round (its round split: verify and propose are the RPC walls,
gateway the rest; gateway/request.py Observer.round_split) and from the re-syncs' times.

    round(B, m, steps) = gateway + verify(B, B + m) + [m > 0] propose(B, steps, m)

- verify(B, T): T = B + m tokens, one per request and its m drafts; lines per batch bucket (B = 1, 2, 3-4,
  5-8, ... : ceil(log2 B)), since the price of one more token falls with the batch (a MoE verify at batch 1
  reads more experts for each extra token; at batch 32 it reads them all anyway).
- propose(B, steps, m): the RPC and its B requests, one MTP step per draft depth (steps = the largest k)
  and one row per draft token (m = sum of k). No Propose (m = 0) costs nothing. The draft's catch-up over a
  new request's committed tokens (its first Propose, or a re-sync's) is paid once per request, not per
  round: such rounds are kept out of propose(), and give the catch-up's price per row (probe_s).
- gateway: the round less both RPCs, a moving average over rounds without drafts; what a drafting round's
  gateway share takes beyond that is counted in its propose().

Each (B, T) of verify and each (B, steps, m) of propose keeps the median of its last WINDOW measurements:
what a round of exactly that shape costs, read directly. One slow round (a first call of a shape, a kernel
compiled on first use, a neighbour's burst on the machine) cannot move a median of three. A median not
renewed in FRESH rounds is not read any more (context, load and the machine move): such shapes, and shapes not
measured yet, are read off a line fitted to the measured ones (weighted by their counts, fading with age; no
negative slope: one more token or step never looks like a saving); a bucket with no measurement at all
borrows its nearest measured neighbour's line.

A round without drafts is priced by its own measurements only (plain_s), not off the line: a verify of one
token per request is a different step from one with drafts (on this project's 2-core CPU at batch 1 the line
through 2-4 tokens priced a plain round at 15-17 ms while plain rounds took 12-13 ms), and pricing it off the
line made drafting look cheaper than it was (in a replay of that CPU's costs with 20x slow first calls,
batch 32 drafted k ~ 3 at 0.67-0.75x of K = 0). Plain shapes stay in the line (it prices drafting shapes not measured lately; without
them, first calls of new shapes could bend it flat). Plain rounds are measured whenever nobody drafts; while a
bucket drafts every round, the policy runs PLAIN_RUN of them every PLAIN_EVERY (gateway/adaptive.py).
"""
from __future__ import annotations

from collections import deque
from statistics import median

WINDOW = 5              # measurements kept per shape (their median is its cost)
TRUST = 3               # measurements of a shape before its own median is used instead of the line
FRESH = 32              # rounds of its table after which a shape's median is stale (read off the line)
AGE = 0.98              # weight of a shape in the line, per round since its last measurement
GATEWAY_RATE = 0.1      # moving average of the gateway's share of a round
OUTLIER = 2.0           # a shape this many times the line through the rest stays out of it
PRICE_ROUNDS = 8        # rounds a priced round shape is reused (CostModel.pricer)


class Shape:
    """The last WINDOW measurements of one round shape, and when it was last measured."""

    def __init__(self):
        self.obs: deque[float] = deque(maxlen=WINDOW)
        self.last = 0
        self.value = 0.0                            # median(obs), kept as obs change (read every round)

    def add(self, y: float, now: int) -> None:
        self.obs.append(y)
        self.last = now
        self.value = median(self.obs)


class Table:
    """Costs by shape (a tuple of inputs): the shape's own median when measured TRUST times, else a linear fit
    y ~ c0 + c . x over the measured shapes' medians (module docstring)."""

    def __init__(self):
        self.shapes: dict[tuple, Shape] = {}
        self._coef: list[float] | None = None      # the line as of the last add's round; None: not fitted since
        self._now = 0

    def add(self, x: tuple, y: float, now: int) -> None:
        self.shapes.setdefault(x, Shape()).add(y, now)
        self._coef, self._now = None, now           # refitted when a prediction needs it (most read trusted shapes)

    @property
    def coef(self) -> list[float] | None:
        """[c0, c1, ...] of the line; None until something is measured."""
        if self._coef is None and self.shapes:
            self._coef = line(self.shapes, self._now)
        return self._coef

    def predict(self, x: tuple) -> float | None:
        s = self.shapes.get(x)
        if s is not None and len(s.obs) >= TRUST and self._now - s.last <= FRESH:
            return s.value
        coef = self.coef
        if coef is None:
            return None
        y = coef[0]
        for i, v in enumerate(x, 1):                # a plain loop: called ~100 times a round at batch 32
            y += coef[i] * v
        return max(0.0, y)


def line(shapes: dict[tuple, Shape], now: int) -> list[float]:
    """Weighted least squares of the shapes' medians on their inputs, with no negative slope (a feature whose
    slope comes out negative is dropped and the rest refitted); ridge-guarded against inputs that do not vary.
    A shape whose median is more than OUTLIER times the line through the rest (and the cheapest of the rest) is a
    fault of its measurements (first calls of a shape in most of its rounds), not a price: it stays out (the three
    dearest shapes are checked)."""
    trusted = {x: s for x, s in shapes.items() if len(s.obs) >= TRUST}
    if len(trusted) >= 2:               # a shape measured once or twice (maybe a slow first call) stays out
        shapes = trusted
    pts = [(x, s.value, len(s.obs) * AGE ** (now - s.last)) for x, s in shapes.items()]
    coef = fit(pts)
    for p in sorted(pts, key=lambda p: -p[1])[:3]:         # the dearest shapes, each against the line of the rest
        rest = [q for q in pts if q is not p]
        if len(rest) < 2:
            break
        c = fit(rest)
        if p[1] > OUTLIER * max(at(c, p[0]), min(q[1] for q in rest)):
            pts, coef = rest, c
    return coef


def at(coef: list[float], x: tuple) -> float:
    return coef[0] + sum(c * v for c, v in zip(coef[1:], x))


def fit(pts: list[tuple]) -> list[float]:
    """The weighted, non-negative-slope least squares of line() over (x, y, weight) points."""
    size = 1 + len(pts[0][0])
    active = list(range(1, size))
    while True:
        cols = [0] + active
        a = [[sum(w * feat(x, i) * feat(x, j) for x, _, w in pts) + (1e-6 if i == j and i else 0.0) for j in cols]
             for i in cols]
        b = [sum(w * feat(x, i) * y for x, y, w in pts) for i in cols]
        theta = solve(a, b)
        neg = [c for c, t in zip(cols[1:], theta[1:]) if t < 0]
        if not neg:
            coef = [0.0] * size
            for c, t in zip(cols, theta):
                coef[c] = t
            return coef
        active.remove(min(neg, key=lambda c: theta[cols.index(c)]))


def feat(x: tuple, i: int) -> float:
    return 1.0 if i == 0 else float(x[i - 1])


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive semi-definite a (Gaussian elimination with partial pivoting;
    a direction with no information gets 0)."""
    size = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(size):
        p = max(range(c, size), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(c + 1, size):
            f = m[r][c] / m[c][c]
            for j in range(c, size + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * size
    for c in reversed(range(size)):
        if abs(m[c][c]) >= 1e-300:
            x[c] = (m[c][size] - sum(m[c][j] * x[j] for j in range(c + 1, size))) / m[c][c]
    return x


def bucket(batch: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ..."""
    return max(0, batch - 1).bit_length()


class CostModel:
    """Seconds of a round's parts, predicted from the rounds measured so far (module docstring)."""

    def __init__(self):
        self.verify: dict[int, Table] = {}
        self.propose = Table()
        self.gateway = 0.0
        self.rounds = 0
        self.catchup = Shape()                            # propose seconds per catch-up row (first Proposes)
        self.resync_per_token: float | None = None       # seconds a re-sync takes per committed token
        self._prices: dict[int, tuple[int, dict]] = {}    # batch -> (round priced, {(drafts, steps): seconds})

    def verify_s(self, batch: int, tokens: int) -> float:
        b = bucket(batch)
        t = self.verify.get(b)
        y = self.plain_s(batch) if tokens == batch else None
        if y is None and t is not None:
            y = t.predict((batch, tokens))
        if y is None:                   # a new bucket: its nearest measured neighbour's line
            near = min((k for k, f in self.verify.items() if f.coef), key=lambda k: abs(k - b), default=None)
            y = 0.0 if near is None else self.verify[near].predict((batch, tokens)) or 0.0
        return y

    def plain_s(self, batch: int) -> float | None:
        """verify of a round without drafts, from the bucket's plain rounds alone (module docstring): this
        batch's median, at any age, or the nearest batch's moved along the line's batch and token slopes.
        None (read off the line; the policy runs plain rounds): no plain shape of the bucket has TRUST rounds."""
        t = self.verify.get(bucket(batch))
        if t is None:
            return None
        slope = t.coef[1] + t.coef[2] if t.coef is not None else 0.0      # one more request, one more token
        best = None                                 # the nearest TRUST-ed shape: (distance, age), batch, price
        for x, s in t.shapes.items():
            if x[0] == x[1] and len(s.obs) >= TRUST:
                key = (abs(x[0] - batch), -s.last)
                if best is None or key < best[0]:
                    best = (key, x[0], s.value)
        return None if best is None else max(0.0, best[2] + slope * (batch - best[1]))

    def plain_age(self, batch: int) -> int | None:
        """Rounds since this batch's bucket last ran a round without drafts (None: never)."""
        t = self.verify.get(bucket(batch))
        last = max((s.last for x, s in t.shapes.items() if x[0] == x[1]), default=None) if t else None
        return None if last is None else self.rounds - last

    def propose_s(self, batch: int, steps: int, drafts: int) -> float:
        return (self.propose.predict((batch, steps, drafts)) or 0.0) if drafts else 0.0

    def pricer(self, batch: int):
        """round_s for one batch size as a function (drafts, steps) -> seconds. The policy prices ~100 points
        of a batch-32 round, mostly the same points round after round: each is kept for PRICE_ROUNDS rounds
        (the medians it reads move slowly), and the gateway's share is added fresh."""
        t = self.verify.get(bucket(batch))
        if t is None or not t.shapes:                 # (not t.coef: that would refit the line every round)
            return lambda drafts, steps: self.round_s(batch, drafts, 0, steps)
        born, memo = self._prices.get(batch, (-PRICE_ROUNDS, None))
        if memo is None or self.rounds - born >= PRICE_ROUNDS:
            memo = {}
            self._prices[batch] = (self.rounds, memo)
        verify, propose, gateway = t.predict, self.propose.predict, self.gateway

        def price(drafts: int, steps: int) -> float:
            y = memo.get((drafts, steps))
            if y is None:
                if drafts:
                    y = (verify((batch, batch + drafts)) or 0.0) + (propose((batch, steps, drafts)) or 0.0)
                else:
                    y = self.verify_s(batch, batch)
                memo[drafts, steps] = y
            return gateway + y
        return price

    def round_s(self, batch: int, drafts: int, rows0: int = 0, steps: int = 0) -> float:
        """A round of `batch` requests with `drafts` draft tokens in all, at most `steps` per request (rows0,
        the committed rows the draft catches up on, is a once-per-request cost: not charged to the round)."""
        return self.gateway + self.verify_s(batch, batch + drafts) + self.propose_s(batch, steps, drafts)

    def measured(self, batch: int) -> int:
        """Shapes the verify table of this batch's bucket has measured."""
        t = self.verify.get(bucket(batch))
        return 0 if t is None else len(t.shapes)

    # --- observations --------------------------------------------------------------------------------
    def observe_round(self, batch: int, tokens: int, split: dict[str, float], propose: tuple | None) -> None:
        """One round's split (seconds by phase); propose: (rows0, steps, drafts) when its Propose drafted."""
        self.rounds += 1
        if "verify" in split:
            self.verify.setdefault(bucket(batch), Table()).add((batch, tokens), split["verify"], self.rounds)
        gateway = max(0.0, split.get("gateway", 0.0))
        if tokens == batch:                           # no drafts: the gateway's share of a plain round
            self.gateway += GATEWAY_RATE * (gateway - self.gateway)
        if propose is not None and split.get("propose", 0.0) > 0:
            rows0, steps, drafts = propose
            # a drafting round's gateway share beyond a plain round's (its commit beside the draft's work,
            # more tokens to commit) is the Propose's too: 1-7 ms a round on a 2-core CPU
            cost = split["propose"] + max(0.0, gateway - self.gateway)
            if rows0 <= 2 * (batch + drafts):          # a steady round: about the last round's tokens
                self.propose.add((batch, steps, drafts), cost, self.rounds)
            else:                                     # a catch-up: what it cost beyond a steady round, per row
                extra = cost - self.propose_s(batch, steps, drafts)
                self.catchup.add(max(0.0, extra) / rows0, self.rounds)

    def observe_resync(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            per = seconds / tokens
            old = self.resync_per_token
            self.resync_per_token = per if old is None else old + 0.25 * (per - old)

    def probe_s(self, tokens: int, batch: int = 1) -> float:
        """A re-sync of a request of `tokens` committed tokens and its probe round (the draft's catch-up over
        them, 1 draft)."""
        per = self.resync_per_token
        if per is None:                 # never measured: as much as the draft's catch-up
            per = 0.0
        row = self.catchup.value if self.catchup.obs else 0.0
        return (per + row) * tokens + self.propose_s(batch, 1, 1)
