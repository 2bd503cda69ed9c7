"""Ranking a chain's rejection outcomes for ``Predraft`` (``drafters/protocol.py``): which "d_0 .. d_{k-1}
accepted, the target's token at k is t" a drafter should draft ahead for first.

The drafter's own view stands in for the target's: an outcome's weight is P(d_0) .. P(d_{k-1}) * P_k(t) under the
laws the chain's nodes were drawn from (softmax(logits / T) at the row's temperature; greedy rows use T = 1, the
drafter's confidence), and only the ``ALTS`` likeliest other tokens at each node are candidates. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

ALTS = 2  # other tokens considered per chain node


def node_rank(logits: torch.Tensor, drawn: int, temperature: float, image_token_id: int | None,
              alts: int = ALTS) -> tuple[float, list[tuple[int, float]]]:
    """One chain node: logits [V] it was drawn from, its token ``drawn`` -> (P(drawn), [(t, P(t))] for the
    ``alts`` likeliest other tokens with P > 0), under softmax(logits / temperature) without the image token."""
    row = logits.detach().float().clone()  # [V]
    if image_token_id is not None:
        row[image_token_id] = float("-inf")
    probs = torch.softmax(row / temperature, dim=-1)  # [V]
    top = probs.topk(min(alts + 1, probs.shape[-1]))
    others = [(i, p) for i, p in zip(top.indices.tolist(), top.values.tolist()) if i != drawn and p > 0]
    return float(probs[drawn]), others[:alts]


def best_outcome(rank: Callable[[int], tuple[float, list[tuple[int, float]]]], last: int,
                 opened: Collection[tuple[int, int]]) -> tuple[int, int] | None:
    """The likeliest outcome (k, t), k = 0 .. ``last``, not in ``opened``; ``rank(k)`` is node k's ``node_rank``
    (called in order of k, only as far as needed). None when every candidate is opened."""
    best, reach = None, 1.0
    for k in range(last + 1):
        own, alts = rank(k)
        for t, pt in alts:
            if (k, t) not in opened and (best is None or reach * pt > best[0]):
                best = (reach * pt, k, t)
        reach *= own
    return None if best is None else (best[1], best[2])
