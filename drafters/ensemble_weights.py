"""Adaptive member weights of the in-batch ensemble: each request's mixture leans towards the members that have
predicted its committed tokens best so far.

IbED mixes its members with fixed weights. On a request where one member is clearly better (the multimodal member
on a long caption, the text member on a text-only turn), a fixed mixture spends mass on the weaker ones and lands
between them. Here each request keeps, per member m, the log-likelihood L_m of the tokens the target committed so
far under that member (the member's own distribution at each committed position, at the request's temperature;
greedy requests at temperature 1, as they are mixed), and drafts from

    post_m  ∝ w_m · exp(eta · (L_m - max_m L_m))          (Bayesian model averaging when eta = 1)
    weight_m = (1 - floor) · post_m + floor · w_m / sum(w)  (a floor: a member that falls behind can come back)

with w the configured weights (equal by default). The weights depend only on tokens already committed, and q is
the mixture with the weights the draft was actually drawn from, so the output stays exactly the target's.

Which positions count: every accepted draft token (from the distribution it was drawn from) and the target's next
token when the drafter had drawn at that position (not the bonus token after a fully accepted block: no member
distribution was computed there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def check_adapt(eta, floor, where: str) -> tuple[float, float]:
    """Validate the ``adapt`` (eta >= 0; 0 = fixed weights) and ``adapt_floor`` (0 <= floor <= 1) options."""
    for name, v, hi in (("adapt", eta, math.inf), ("adapt_floor", floor, 1.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= hi:
            raise ValueError(f"{where}: {name} must be a number in [0, {hi}], got {v!r}")
    return float(eta), float(floor)


def posterior(prior: Sequence[float], loglik: Sequence[float], eta: float) -> list[float] | None:
    """post_m (summing to 1) from the configured weights and each member's log-likelihood so far, or None when
    nothing was learnt (eta 0, one member, no member gave the committed tokens mass, or only zero-weight ones did)."""
    total = sum(prior)
    if eta == 0 or len(prior) < 2:
        return None
    top = max(loglik)
    if not math.isfinite(top):
        return None
    post = [w / total * math.exp(eta * (ll - top)) for w, ll in zip(prior, loglik)]
    z = sum(post)
    return [p / z for p in post] if z > 0 else None


def adapted_weights(prior: Sequence[float], loglik: Sequence[float], eta: float, floor: float) -> list[float]:
    """The mixture weights (summing to 1) from the configured weights and each member's log-likelihood so far."""
    base = [w / sum(prior) for w in prior]
    post = posterior(prior, loglik, eta)
    if post is None:
        return base
    return [(1 - floor) * p + floor * b for p, b in zip(post, base)]


def committed_logprobs(rows: torch.Tensor, tokens: Sequence[int], temperature: float,
                       image_token_id: int) -> list[float]:
    """Per member, log prod_i softmax(rows[m, i] / T)[tokens[i]] with the image token masked, as the mixture draws:
    rows [M, P, V] (each member's logits at each counted position), tokens [P] the committed token at each."""
    if not len(tokens):
        return [0.0] * rows.shape[0]
    logits = rows.float().clone()  # [M, P, V]
    logits[..., image_token_id] = float("-inf")
    logp = torch.log_softmax(logits / temperature, dim=-1)  # [M, P, V]
    idx = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)  # [P]
    picked = logp.gather(2, idx[None, :, None].expand(logp.shape[0], -1, 1))[..., 0]  # [M, P]
    return picked.sum(1).tolist()
