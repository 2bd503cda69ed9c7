"""The end-to-end distribution check every drafter kind shares (docs/design.md, "End-to-end distribution check").

The first ``k`` tokens a request emits through ``SpecEngine`` (prefill token, then the verifier's) are counted over
the cells of their joint support and compared, by a one-sample Pearson chi-square, with the exact joint law of
plain sampling, which the target gives directly: p(x_1) after the prompt, p(x_2 | x_1) after prompt + x_1, and so
on, through the same ``logits_to_probs``, over every prefix in the support (top_k = 4, k = 3: 1 + 4 + 16 target
rows, 64 cells). Cells expected below ``MIN_EXPECTED`` are pooled; a token outside the support is a p-value of 0.

    law = exact_law(model, base, params, k=3)
    run = sample_first_tokens(model, drafter, base, params, n=4096, k=3)
    assert chi2_test(run.tokens, law).p_value > 1e-4
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specula.runtime.core.sampling import SamplingParams, logits_to_probs
from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.targets import load_target
from specula.targets.types import PrefillRequest

MIN_EXPECTED = 5.0  # cells expected below this are pooled into one (the chi-square approximation needs it)


@dataclass(frozen=True)
class Law:
    """The exact joint law of the first k tokens of plain sampling."""

    cells: torch.Tensor  # [C, k] int64, every token sequence with probability > 0
    probs: torch.Tensor  # [C] fp64, their probabilities (sum 1)
    steps: list[dict[tuple[int, ...], torch.Tensor]]  # steps[j][prefix] = p(x_{j+1} | prefix) [V] fp32, len(prefix) = j


@dataclass(frozen=True)
class Run:
    """What a speculative (or plain) run emitted, and how its drafts fared."""

    tokens: torch.Tensor  # [n, k] int64, each request's first k tokens
    accepted: int  # draft tokens accepted, over all requests
    rejected: int  # blocks that drafted and had their first level rejected (nothing accepted), over all requests


@torch.no_grad()
def exact_law(model, base: GenerationRequest, params: SamplingParams, k: int) -> Law:
    """Exact joint law of the first ``k`` tokens of ``base`` under ``params`` on ``model`` (a plain target)."""
    target = load_target(model)
    steps: list[dict[tuple[int, ...], torch.Tensor]] = []
    prefixes: list[tuple[int, ...]] = [()]
    for j in range(k):
        reqs = [PrefillRequest(f"x{i}", torch.cat([base.input_ids, torch.tensor(pre, dtype=torch.long)]),
                               base.pixel_values) for i, pre in enumerate(prefixes)]
        out = target.prefill(reqs)
        target.release([r.request_id for r in reqs])
        p = logits_to_probs(out.logits, params)  # [P, V] fp32
        steps.append({pre: p[i] for i, pre in enumerate(prefixes)})
        prefixes = [pre + (t,) for i, pre in enumerate(prefixes) for t in p[i].nonzero().flatten().tolist()]
    cells = torch.tensor(prefixes, dtype=torch.long)  # [C, k]
    probs = torch.ones(len(prefixes), dtype=torch.float64)  # [C]
    for j in range(k):
        probs *= torch.stack([steps[j][tuple(c[:j])][c[j]].double() for c in prefixes])
    return Law(cells, probs / probs.sum(), steps)


def sample_first_tokens(model, drafter, base: GenerationRequest, params: SamplingParams, n: int, k: int,
                        seed0: int = 0, gamma: int = 3, chunk: int = 256, siblings: str = "without_replacement",
                        max_tokens: int | None = None, target=None, choices: tuple | None = None,
                        policy=None, begin_after: int = 0) -> Run:
    """n copies of ``base`` (seeds seed0 .. seed0 + n - 1), ``chunk`` per ``generate`` call, through ``drafter``
    (None: plain sampling). ``max_tokens`` (default k) caps drafting: the first block holds at most
    max_tokens - 2 drafts, so it must exceed k for a draft deeper than k - 1 to be decided in the first k tokens.
    ``target``: the loaded target the drafter was built on (default: a fresh one from ``model``). ``choices``: request
    i chooses drafter ``choices[i % len(choices)]`` by name (a multi-drafter; None: the default). ``policy``: the
    engine's draft-length policy (``SpecEngine.policy``, runtime/engine/adaptive.py's interface). ``begin_after``:
    the drafter begins once a request has that many tokens (SpecEngine's)."""
    engine = SpecEngine(target or load_target(model), drafter, gamma=gamma, eos_token_ids=[-1], siblings=siblings,
                        adaptive=policy is not None, begin_after=begin_after)
    if policy is not None:
        engine.policy = policy
    p = dataclasses.replace(params, max_tokens=max_tokens or k)
    reqs = [GenerationRequest(f"s{seed0 + i}", base.input_ids, base.pixel_values, dataclasses.replace(p, seed=seed0 + i),
                              drafter=choices[i % len(choices)] if choices else None) for i in range(n)]
    tokens, accepted, rejected = [], 0, 0
    for i in range(0, n, chunk):
        res = engine.generate(reqs[i:i + chunk])
        for r in reqs[i:i + chunk]:
            m = res[r.request_id].metrics
            tokens.append(res[r.request_id].tokens[:k])
            accepted += m.accepted_tokens
            rejected += (m.drafted_at[0] - m.accepted_at[0]) if m.drafted_at else 0
    return Run(torch.tensor(tokens, dtype=torch.long), accepted, rejected)  # tokens [n, k]


@dataclass(frozen=True)
class Chi2:
    """A chi-square test's outcome; ``(stat - df) / n`` estimates the chi-square divergence sum (pi' - pi)^2 / pi
    of the law sampled from the target's (the statistic is about noncentral chi-square, noncentrality n times it)."""

    stat: float
    df: int
    p_value: float
    n: int

    @property
    def divergence(self) -> float:
        return max(self.stat - self.df, 0.0) / self.n


def chi2_test(tokens: torch.Tensor, law: Law, min_expected: float = MIN_EXPECTED) -> Chi2:
    """Pearson's chi-square test that the rows of ``tokens`` [n, k] are draws from ``law``.

    Cells expected below ``min_expected`` are pooled into one; a row outside the support gives p-value 0.
    """
    n, k = tokens.shape
    key = torch.tensor([1 << (20 * j) for j in range(k)], dtype=torch.long)  # [k], token ids < 2**20
    cell_of = {c: i for i, c in enumerate((law.cells * key).sum(-1).tolist())}
    idx = [cell_of.get(t, -1) for t in (tokens * key).sum(-1).tolist()]  # [n] cell of each row
    if -1 in idx:
        return Chi2(float("inf"), len(cell_of) - 1, 0.0, n)
    observed = torch.bincount(torch.tensor(idx), minlength=len(cell_of)).double()  # [C]
    expected = n * law.probs  # [C]
    small = expected < min_expected
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2)
    return Chi2(float(stat), df, float(p), n)
