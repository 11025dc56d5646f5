"""What a speculative round costs, as the adaptive policy (gateway/adaptive.py) predicts it: fitted live to
the phase times the scheduler measures each round (its round split: verify and propose are the RPC walls,
gateway the rest; gateway/request.py Observer.round_split) and to the re-syncs' times.

    round(B, m, rows0, steps) = gateway + verify_B(B + m) + [m > 0] propose(rows0, steps, m)

- verify_B(T) = v0 + v1 T: one line per batch bucket (B = 1, 2, 3-4, 5-8, ... : ceil(log2 B)), since the
  price of one more token falls with the batch (a MoE verify at batch 1 reads more experts for each extra
  token; at batch 32 it reads them all anyway). T = B + m tokens: one per request and its m drafts.
- propose = p0 + p1 rows0 + p2 steps + p3 m: the RPC and row transfer (p0), the draft's catch-up step over
  the rows0 committed tokens it is given, one MTP step per draft depth (steps = the largest k) and one
  row per draft token (m = sum of k). No Propose (m = 0) costs nothing.
- gateway: the round less both RPCs, a moving average.

Each fit is least squares over the recent rounds (weights decay by DECAY a round: costs move with the
context length and the machine's load), ridge-regularised towards a prior (a new bucket starts from its
nearest measured neighbour) so that a fit with few rounds, or with no spread in its inputs (every round
the same T), stays near what is known instead of wandering. Predictions use no negative coefficient: an
extra token or step never looks like a saving.
"""
from __future__ import annotations

DECAY = 0.97            # weight of a past round, per newer round (about 30 rounds of memory)
RIDGE = 1.0             # the prior counts as this many rounds
SPREAD = 0.2            # an input varying by this share of its scale (std) measures its coefficient
RECENT = 0.7            # decay of the sums that tell whether an input varied lately
PIN = 1000.0            # ridge (in rounds) holding a coefficient whose input did not vary lately


class Fit:
    """y ~ theta . x (x[0] = 1) by exponentially weighted least squares, ridge-regularised towards `prior`
    (feature i's ridge is RIDGE * scale[i] ** 2: deviating by d in theta_i costs as much as an error of
    scale[i] * d on one round). The prior follows the fit in each direction the recent rounds spread
    over (a coefficient seen only through a constant input keeps its last well-measured value, not
    zero: it is pinned there until its input varies again); without a prior (`informed` False) the ridge
    is only a guard against a singular system."""

    def __init__(self, prior: list[float], scale: list[float], informed: bool):
        self.prior, self.scale, self.informed = list(prior), list(scale), informed
        size = len(prior)
        self.sxx = [[0.0] * size for _ in range(size)]
        self.sxy = [0.0] * size
        self.theta, self.n = list(prior), 0.0
        self.recent = [[0.0] * size, [0.0] * size, 0.0]      # fast-decaying sums of x, x^2 and the count

    def add(self, x: list[float], y: float) -> None:
        size = len(x)
        for i in range(size):
            self.sxy[i] = DECAY * self.sxy[i] + x[i] * y
            row = self.sxx[i]
            for j in range(size):
                row[j] = DECAY * row[j] + x[i] * x[j]
        self.n = DECAY * self.n + 1
        s1, s2, _ = self.recent
        for i in range(size):
            s1[i], s2[i] = RECENT * s1[i] + x[i], RECENT * s2[i] + x[i] * x[i]
        self.recent[2] = n = RECENT * self.recent[2] + 1
        varied = [i == 0 or s2[i] / n - (s1[i] / n) ** 2 >= (SPREAD * self.scale[i]) ** 2 for i in range(size)]
        # a coefficient whose input has not varied lately is pinned to its last measured value
        ridge = [(RIDGE if v else PIN) * sc ** 2 if self.informed else 1e-3 * sc ** 2 for v, sc in zip(varied, self.scale)]
        a = [[self.sxx[i][j] + (ridge[i] if i == j else 0.0) for j in range(size)] for i in range(size)]
        self.theta = solve(a, [self.sxy[i] + ridge[i] * self.prior[i] for i in range(size)])
        self.prior[0] = self.theta[0]
        for i in range(1, size):
            if varied[i]:
                self.prior[i], self.informed = self.theta[i], True

    def predict(self, x: list[float]) -> float:
        return sum(max(0.0, t) * v for t, v in zip(self.theta, x))


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive definite a (Gaussian elimination with partial pivoting)."""
    size = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(size):
        p = max(range(c, size), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return [0.0] * size
        for r in range(c + 1, size):
            f = m[r][c] / m[c][c]
            for j in range(c, size + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * size
    for c in reversed(range(size)):
        x[c] = (m[c][size] - sum(m[c][j] * x[j] for j in range(c + 1, size))) / m[c][c]
    return x


def bucket(batch: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ..."""
    return max(0, batch - 1).bit_length()


class CostModel:
    """Seconds of a round's parts, predicted from the rounds measured so far (module docstring)."""

    def __init__(self):
        self.verify: dict[int, Fit] = {}
        self.propose = Fit([0.0, 0.0, 0.0, 0.0], [1.0, 64.0, 2.0, 16.0], informed=False)
        self.gateway = 0.0
        self.resync_per_token: float | None = None       # seconds a re-sync takes per committed token

    def _verify_fit(self, b: int) -> Fit:
        fit = self.verify.get(b)
        if fit is None:                 # a new bucket starts where its nearest measured neighbour is
            near = min((k for k, f in self.verify.items() if f.n > 0), key=lambda k: abs(k - b), default=None)
            prior = list(self.verify[near].theta) if near is not None else [0.0, 0.0]
            fit = self.verify[b] = Fit(prior, [1.0, float(1 << b)], informed=near is not None)
        return fit

    def verify_s(self, batch: int, tokens: int) -> float:
        return self._verify_fit(bucket(batch)).predict([1.0, float(tokens)])

    def propose_s(self, rows0: int, steps: int, drafts: int) -> float:
        return self.propose.predict([1.0, float(rows0), float(steps), float(drafts)]) if drafts else 0.0

    def round_s(self, batch: int, drafts: int, rows0: int, steps: int) -> float:
        """A round of `batch` requests with `drafts` draft tokens in all, at most `steps` per request."""
        return self.gateway + self.verify_s(batch, batch + drafts) + self.propose_s(rows0, steps, drafts)

    def measured(self, batch: int) -> int:
        """Rounds (decayed) the verify fit of this batch's bucket has seen."""
        fit = self.verify.get(bucket(batch))
        return 0 if fit is None else round(fit.n)

    # --- observations --------------------------------------------------------------------------------
    def observe_round(self, batch: int, tokens: int, split: dict[str, float], propose: tuple | None) -> None:
        """One round's split (seconds by phase); propose: (rows0, steps, drafts) when its Propose drafted."""
        if "verify" in split:
            self._verify_fit(bucket(batch)).add([1.0, float(tokens)], split["verify"])
        if propose is not None and split.get("propose", 0.0) > 0:
            rows0, steps, drafts = propose
            self.propose.add([1.0, float(rows0), float(steps), float(drafts)], split["propose"])
        if "gateway" in split:
            self.gateway += (1 - DECAY) * 3 * (max(0.0, split["gateway"]) - self.gateway)

    def observe_resync(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            per = seconds / tokens
            old = self.resync_per_token
            self.resync_per_token = per if old is None else old + 0.25 * (per - old)

    def probe_s(self, tokens: int) -> float:
        """A re-sync of a request of `tokens` committed tokens and its probe round (Propose of them, 1 draft)."""
        per = self.resync_per_token
        if per is None:                 # never measured: as much as the draft's catch-up, twice
            per = max(self.propose.theta[1], 0.0)
        return per * tokens + self.propose_s(tokens, 1, 1)
