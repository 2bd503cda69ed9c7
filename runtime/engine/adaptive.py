"""How many tokens to draft in the next step: the draft length that maximises expected goodput, learnt online.

Speculation pays only when the tokens it adds per verification outweigh what drafting and the longer verification
cost. Both sides move: acceptance differs per request (a caption accepts most drafts, a one-word answer or an
unfamiliar image few) and the cost of verifying grows with the batch (eight rows of gamma + 1 tokens are a much
bigger forward than eight single tokens). ``GoodputPolicy`` chooses, before every step, the block length ``k`` in
0 .. gamma that maximises

    goodput(k) = sum_r E_r(k) / (T_verify(B, B * (k + 1)) + T_draft(k, B k))    E_r(k) = (1 - a_r^(k+1)) / (1 - a_r)

where E_r(k) is row r's expected emitted tokens from a block of k drafts (bonus included) with per-position
acceptance a_r, T_verify(B, n) the target's forward over B rows of n tokens in all and T_draft(k, B k) the
drafter's time for a block of k for B rows (0 when nothing is drafted). Both costs are fitted with a term per row
and a term per token: on a CPU a row's attention over its long (image) context costs about as much as several of
its new tokens, so eight rows of five tokens cost far less than five times eight rows of one, and a model linear
in tokens alone backs off at eight rows while drafting still pays. ``k = 0`` is a plain step: the drafter is not
asked, the rows still go on (the drafter observes the verdict as always). So speculation backs off by itself as
the batch grows, or for a request whose drafts keep being rejected, and comes back when the batch shrinks or
acceptance returns.

Lossless by construction: the policy only changes how many tokens are drafted, never how they are verified.

Learning: a_r is a decayed count of accepted drafts over accepted drafts plus rejections (the maximum-likelihood
acceptance of a geometric model), starting from the acceptance seen across recent rows (``population``: the same
count over every row's blocks, slower to decay; ``prior`` until there is one) and drifting back to it while the row
is not drafted (so a row that backed off is tried again). A new caption then drafts long from its first block when
captions have been accepted, instead of a block or two sized for a stranger. T_verify and T_draft are least-squares
fits over the steps seen (decayed, weights past the intercept kept >= 0), with ``warmup`` steps of lengths gamma,
0, gamma, gamma / 2 before the policy decides anything; the first (``cold``) step's costs are not fitted (a
drafter's first call sets itself up: one such step, 20x slow, once held a policy at 3 of 8 drafts for a whole run),
and every ``explore_every``-th step drafts a probe length far from the best (``probe``), so both lines keep recent
points at two lengths and one slow step cannot bend them for good. Tree drafters choose between 0 and gamma only
(their budget is nodes, not a chain's length).

    policy = GoodputPolicy(gamma=5)
    k = policy.choose(["r1", "r2"])                 # before the step
    policy.record_step(["r1", "r2"], k, draft_s=0.004, verify_s=0.012, drafted=[5, 5], accepted=[5, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Fit:
    """y ~ w . x by decayed least squares; x[0] is 1 (the intercept), every other weight is kept >= 0 (a forward
    never gets cheaper with more rows or tokens): among the models on a subset of the features (intercept always
    in) whose weights are all >= 0, the one with the least residual, the smaller model on a tie (so a feature that
    never varied, e.g. one batch size only, adds nothing)."""

    size: int
    decay: float = 0.98
    n: float = 0.0
    s: list = field(init=False)  # [size, size] decayed sum of x x^T
    r: list = field(init=False)  # [size] decayed sum of x y
    yy: float = 0.0
    refit: int = 8  # past the first 2 * refit points, the weights are solved again every refit points
    _w: tuple | None = field(default=None, init=False)  # the weights, until they are solved again
    _since: int = field(default=0, init=False)  # points added since

    def __post_init__(self) -> None:
        self.s = [[0.0] * self.size for _ in range(self.size)]
        self.r = [0.0] * self.size

    def add(self, x: Sequence[float], y: float) -> None:
        d = self.decay
        self.n, self.yy = d * self.n + 1, d * self.yy + y * y
        for i in range(self.size):
            self.r[i] = d * self.r[i] + x[i] * y
            for j in range(self.size):
                self.s[i][j] = d * self.s[i][j] + x[i] * x[j]
        self._since += 1
        if self.n < 2 * self.refit or self._since >= self.refit:  # costs drift slowly: no solve every step
            self._w, self._since = None, 0

    def weights(self) -> tuple[float, ...] | None:
        if self.n < 1:
            return None
        if self._w is None:
            w = _solve(self.s, self.r)  # the whole model, when its slopes are >= 0, has the least residual of all
            if w is not None and all(v >= 0 for v in w[1:]):
                self._w = tuple(w)
                return self._w
            best, best_res = None, float("inf")
            for keep in _subsets(self.size)[:-1]:  # smallest first; the whole model failed above
                w = _solve([[self.s[i][j] for j in keep] for i in keep], [self.r[i] for i in keep])
                if w is None or any(v < 0 for v in w[1:]):
                    continue
                res = self.yy - 2 * sum(wi * self.r[i] for wi, i in zip(w, keep)) + sum(
                    wi * wj * self.s[i][j] for wi, i in zip(w, keep) for wj, j in zip(w, keep))
                if res < best_res - 1e-9 * max(abs(self.yy), 1e-12):
                    full = [0.0] * self.size
                    for wi, i in zip(w, keep):
                        full[i] = wi
                    best, best_res = tuple(full), res
            self._w = best if best is not None else (self.r[0] / self.s[0][0],) + (0.0,) * (self.size - 1)
        return self._w

    def __call__(self, *x: float) -> float | None:
        w = self.weights()
        if w is None:
            return None
        return max(0.0, w[0] + sum(wi * xi for wi, xi in zip(w[1:], x)))


def _subsets(size: int) -> list[tuple[int, ...]]:
    """Index sets that hold 0 (the intercept), by size: (0,), (0, 1), (0, 2), ..., (0, 1, ..., size - 1)."""
    from itertools import combinations

    return [(0, *c) for k in range(size) for c in combinations(range(1, size), k)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting; None when a is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(max(abs(v) for v in row[:n]) for row in m) or 1.0
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        if abs(m[p][c]) <= 1e-10 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for i in range(c + 1, n):
            f = m[i][c] / m[c][c]
            for j in range(c, n + 1):
                m[i][j] -= f * m[c][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


@dataclass
class _Acceptance:
    accepted: float
    rejected: float

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class GoodputPolicy:
    """Chooses each step's draft length (see the module doc). ``gamma``: the most it drafts."""

    gamma: int
    tree: bool = False
    prior: float = 0.6  # acceptance assumed for a new row
    prior_weight: float = 2.0  # in blocks
    decay: float = 0.9  # per block, for a row's acceptance
    warmup: int = 4  # steps of set lengths before choosing (the cost lines need points at several lengths)
    cold: int = 1  # first steps whose costs are not fitted (first calls: lazy set-up, kernels built for new shapes)
    explore_every: int = 32  # past the warm-up, every explore_every-th step drafts a probe length (0 = never)
    verify: _Fit = field(default_factory=lambda: _Fit(3))  # seconds ~ 1, rows, tokens of the verify forward
    draft: _Fit = field(default_factory=lambda: _Fit(3))  # seconds ~ 1, k, k * rows drafted (steps that drafted)
    rows: dict[str, _Acceptance] = field(default_factory=dict)
    population_decay: float = 0.98  # per block of any row, for the acceptance across rows
    population: _Acceptance | None = None  # decayed counts over every row's blocks (None: none drafted yet)
    steps: int = 0

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    def acceptance(self, rid: str) -> float:
        row = self.rows.get(rid)
        return self.start() if row is None else min(max(row.rate, 0.0), 0.999)

    def start(self) -> float:
        """A new row's acceptance: the population's, once blocks were drafted (kept in 0.05 .. 0.95, so one
        workload's extremes never rule a stranger out or in), else ``prior``."""
        pop = self.population
        if pop is None or pop.accepted + pop.rejected < self.prior_weight:
            return self.prior
        return min(max(pop.rate, 0.05), 0.95)

    def expected_tokens(self, rid: str, k: int) -> float:
        """E_r(k): tokens a block of k drafts emits on average (the bonus / corrected token included)."""
        a = self.acceptance(rid)
        return (1 - a ** (k + 1)) / (1 - a)

    def goodput(self, request_ids: Sequence[str], k: int, rows: int | None = None,
                acceptance: Sequence[float] | None = None) -> float | None:
        """Expected tokens per second of a step of k drafts per row of ``request_ids``, in a forward of ``rows``
        rows (default: just them; the others emit one token each); None while a cost is unknown. ``acceptance``:
        the rows' acceptance, if already looked up."""
        b = len(request_ids)
        rows = max(rows or b, b)
        t = self.verify(rows, rows * (k + 1))  # the block is [rows, k + 1], whatever each row drafted
        d = self.draft(k, k * b) if k > 0 else 0.0
        if t is None or d is None:
            return None
        acc = acceptance if acceptance is not None else [self.acceptance(r) for r in request_ids]
        return (sum((1 - a ** (k + 1)) / (1 - a) for a in acc) + rows - b) / max(t + d, 1e-6)

    def choose(self, request_ids: Sequence[str], rows: int | None = None) -> int:
        """The next step's draft length for these rows (0 = a plain step); ``rows``: rows in the step's forward
        when more than these (rows whose drafter has not begun)."""
        if self.gamma == 0 or not request_ids:
            return 0
        if self.steps < self.warmup or self.draft.n < 1:  # a few lengths, so both cost lines get a slope
            half = self.gamma if self.tree else max(1, self.gamma // 2)
            return (self.gamma, 0, self.gamma, half)[self.steps % 4]
        acc = [self.acceptance(r) for r in request_ids]
        best, best_k = -1.0, self.gamma
        for k in ((0, self.gamma) if self.tree else range(self.gamma + 1)):
            g = self.goodput(request_ids, k, rows, acc)
            if g is None:
                return self.gamma
            if g > best * 1.0001:  # ties go to the shorter block
                best, best_k = g, k
        if self.explore_every and (self.steps - self.warmup) % self.explore_every == self.explore_every - 1:
            return self.probe(best_k)
        return best_k

    def probe(self, best: int) -> int:
        """The length an exploring step drafts instead of ``best``: far from it, so both cost lines keep recent
        points at two lengths. Without probes the lines are fitted from the lengths chosen, and one slow step at a
        long block (a preemption, a cold kernel) makes long blocks look dear for good: the policy keeps a short
        length, and never measures a long block again to learn otherwise. A tree probes the other of 0 and its
        budget; a chain probes gamma from a short best and half its best from a long one (at least 1, so a policy
        backed off to plain steps measures drafting again)."""
        if self.tree:
            return 0 if best else self.gamma
        if best <= self.gamma // 2:
            k = self.gamma if best else max(1, self.gamma // 2)
        else:
            k = max(1, best // 2)
        return k if k != best else (0 if best else self.gamma)  # gamma 1: the other of 0 and 1

    def record_step(self, request_ids: Sequence[str], k: int, draft_s: float, verify_s: float,
                    drafted: Sequence[int], accepted: Sequence[int], width: int | None = None,
                    drafting: int | None = None) -> None:
        """What a step cost and what each row accepted: ``drafted[r]`` drafts verified (chain length or tree
        depth), ``accepted[r]`` of them kept; ``width`` the verified block's draft width (every row's forward is
        ``width + 1`` tokens; default the longest ``drafted``), ``drafting`` how many rows the drafter drafted
        for (default all)."""
        self.steps += 1
        rows = len(request_ids)
        width = max(drafted, default=0) if width is None else width
        if self.steps > self.cold:
            self.verify.add((1.0, rows, rows * (width + 1)), verify_s)
            if k > 0:
                self.draft.add((1.0, k, k * (rows if drafting is None else drafting)), draft_s)
        start = self.start()  # before this step's counts: every row of a step starts from the same value
        for rid, n, a in zip(request_ids, drafted, accepted):
            row = self.rows.setdefault(rid, _Acceptance(start * self.prior_weight, (1 - start) * self.prior_weight))
            if n <= 0:  # not drafted: drift back to the start, so a row that backed off is tried again
                row.accepted += 0.1 * (start * self.prior_weight - row.accepted)
                row.rejected += 0.1 * ((1 - start) * self.prior_weight - row.rejected)
                continue
            row.accepted = self.decay * row.accepted + a
            row.rejected = self.decay * row.rejected + (1.0 if a < n else 0.0)
            pop = self.population = self.population or _Acceptance(0.0, 0.0)
            pop.accepted = self.population_decay * pop.accepted + a
            pop.rejected = self.population_decay * pop.rejected + (1.0 if a < n else 0.0)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)
