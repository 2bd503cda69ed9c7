"""How many tokens to draft in the next step: the draft length that maximises expected goodput, learnt online.

Speculation pays only when the tokens it adds per verification outweigh what drafting and the longer verification
cost. Both sides move: acceptance differs per request (a caption accepts most drafts, a one-word answer or an
unfamiliar image few) and the cost of verifying grows with the batch (eight rows of gamma + 1 tokens are a much
bigger forward than eight single tokens). ``GoodputPolicy`` chooses, before every step, the block length ``k`` in
0 .. gamma that maximises

    goodput(k) = sum_r E_r(k) / (T_verify(B * (k + 1)) + T_draft(k))       E_r(k) = (1 - a_r^(k+1)) / (1 - a_r)

where E_r(k) is row r's expected emitted tokens from a block of k drafts (bonus included) with per-position
acceptance a_r, T_verify(n) the target's forward over n tokens and T_draft(k) the drafter's time for a block of k
(0 when nothing is drafted). ``k = 0`` is a plain step: the drafter is not asked, the rows still go on (the drafter
observes the verdict as always). So speculation backs off by itself as the batch grows, or for a request whose
drafts keep being rejected, and comes back when the batch shrinks or acceptance returns.

Lossless by construction: the policy only changes how many tokens are drafted, never how they are verified.

Learning: a_r is a decayed count of accepted drafts over accepted drafts plus rejections (the maximum-likelihood
acceptance of a geometric model), starting from ``prior`` and drifting back to it while the row is not drafted (so a
row that backed off is tried again); T_verify and T_draft are least-squares lines over the steps seen (decayed), with
``warmup`` steps of lengths gamma, 0, gamma, gamma / 2 before the policy decides anything. Tree drafters choose between 0 and gamma only
(their budget is nodes, not a chain's length).

    policy = GoodputPolicy(gamma=5)
    k = policy.choose(["r1", "r2"])                 # before the step
    policy.record_step(["r1", "r2"], k, draft_s=0.004, verify_s=0.012, drafted=[5, 5], accepted=[5, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Line:
    """y ~ a + b x by decayed least squares."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def __call__(self, x: float) -> float | None:
        if self.n < 1:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(self.n * self.sxx, 1.0):  # one x seen so far: a flat line through the mean
            return self.sy / self.n
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var)  # a forward never gets cheaper with more tokens
        a = (self.sy - b * self.sx) / self.n
        return max(0.0, a + b * x)


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
    verify: _Line = field(default_factory=_Line)  # seconds ~ tokens in the verify forward
    draft: _Line = field(default_factory=_Line)  # seconds ~ k, steps that drafted
    rows: dict[str, _Acceptance] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    def acceptance(self, rid: str) -> float:
        row = self.rows.get(rid)
        return self.prior if row is None else min(max(row.rate, 0.0), 0.999)

    def expected_tokens(self, rid: str, k: int) -> float:
        """E_r(k): tokens a block of k drafts emits on average (the bonus / corrected token included)."""
        a = self.acceptance(rid)
        return (1 - a ** (k + 1)) / (1 - a)

    def goodput(self, request_ids: Sequence[str], k: int) -> float | None:
        """Expected tokens per second of a step of k drafts per row; None while a cost is unknown."""
        b = len(request_ids)
        t = self.verify(b * (k + 1))
        d = self.draft(k) if k > 0 else 0.0
        if t is None or d is None:
            return None
        return sum(self.expected_tokens(r, k) for r in request_ids) / max(t + d, 1e-6)

    def choose(self, request_ids: Sequence[str]) -> int:
        """The next step's draft length for these rows (0 = a plain step)."""
        if self.gamma == 0 or not request_ids:
            return 0
        if self.steps < self.warmup or self.draft.n < 1:  # a few lengths, so both cost lines get a slope
            half = self.gamma if self.tree else max(1, self.gamma // 2)
            return (self.gamma, 0, self.gamma, half)[self.steps % 4]
        best, best_k = -1.0, self.gamma
        for k in ((0, self.gamma) if self.tree else range(self.gamma + 1)):
            g = self.goodput(request_ids, k)
            if g is None:
                return self.gamma
            if g > best * 1.0001:  # ties go to the shorter block
                best, best_k = g, k
        return best_k

    def record_step(self, request_ids: Sequence[str], k: int, draft_s: float, verify_s: float,
                    drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """What a step cost and what each row accepted: ``drafted[r]`` drafts verified (chain length or tree
        depth), ``accepted[r]`` of them kept."""
        self.steps += 1
        tokens = sum(n + 1 for n in drafted) if k > 0 else len(request_ids)
        self.verify.add(tokens, verify_s)
        if k > 0:
            self.draft.add(k, draft_s)
        for rid, n, a in zip(request_ids, drafted, accepted):
            row = self.rows.setdefault(rid, _Acceptance(self.prior * self.prior_weight,
                                                        (1 - self.prior) * self.prior_weight))
            if n <= 0:  # not drafted: drift back to the prior, so a row that backed off is tried again
                row.accepted += 0.1 * (self.prior * self.prior_weight - row.accepted)
                row.rejected += 0.1 * ((1 - self.prior) * self.prior_weight - row.rejected)
                continue
            row.accepted = self.decay * row.accepted + a
            row.rejected = self.decay * row.rejected + (1.0 if a < n else 0.0)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)
