"""Ensemble drafting (IbED): the drafter's q is the weighted average of its members' distributions.

Losslessness needs ``q`` to be the law the draft was actually sampled from (docs/design.md, "Ensembles"). For an
ensemble that samples from the averaged distribution, that law is exactly ``mix_distributions(member_qs,
weights)``; verifying against one member's q, or against an average with other weights, is not lossless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def mix_distributions(qs: torch.Tensor | Sequence[torch.Tensor], weights: torch.Tensor | Sequence[float]
                      ) -> torch.Tensor:
    """Weighted average of M distributions: ``sum_m w_m q_m / sum_m w_m``. [M, ..., V] -> [..., V] fp32.

    ``weights`` [M] must be finite, >= 0, with a positive sum; they are normalized here, so [2, 1] means
    2/3 and 1/3. If every q_m sums to 1 so does the result.

    Example: q_1 = [1, 0], q_2 = [.5, .5], weights [3, 1] -> [.875, .125].
    """
    if not isinstance(qs, torch.Tensor):
        qs = torch.stack(list(qs))
    if qs.ndim < 2 or not qs.is_floating_point():
        raise ValueError(f"mix_distributions: qs must be float [M, ..., V], got {qs.dtype} {tuple(qs.shape)}")
    w = [float(v) for v in (weights.tolist() if isinstance(weights, torch.Tensor) else weights)]
    if len(w) != qs.shape[0]:
        raise ValueError(f"mix_distributions: weights has {len(w)} entries for {qs.shape[0]} distributions")
    if any(not math.isfinite(v) or v < 0 for v in w):
        raise ValueError(f"mix_distributions: weights must be finite and >= 0, got {w}")
    total = sum(w)
    if total <= 0:
        raise ValueError(f"mix_distributions: weights must have a positive sum, got {w}")
    wt = torch.tensor([v / total for v in w], dtype=torch.float32, device=qs.device)  # [M]
    return torch.tensordot(wt, qs.float(), dims=1)  # [..., V] fp32
