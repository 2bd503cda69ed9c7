"""Stop tokens in drafting: a drafted stop token (EOS by default) gets no children.

A generation that accepts a stop token is over, so anything drafted after one could never be emitted: drafting it
only costs draft steps and verify width (a short VQA answer then drafts 2-3 tokens instead of gamma). Ending a
branch there is a choice of *what* to draft, never of how a token is drawn, so the output law is untouched: the
children of a node depend only on that node's own (already revealed) token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stop_ids(kind: str, value: Sequence[int] | None, target=None, fallback=None) -> torch.Tensor:
    """The drafter option ``stop_token_ids`` -> a sorted int64 tensor [n_stop].

    None: the target's EOS ids (``target.info.eos_token_ids``), else ``fallback`` (an int, a list of ints or None,
    e.g. the drafter model's ``eos_token_id``); ``[]``: never stop."""
    if value is None:
        value = list(target.info.eos_token_ids) if target is not None else fallback
        value = [] if value is None else [value] if isinstance(value, int) else list(value)
    if isinstance(value, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in value):
        raise ValueError(f"{kind}: stop_token_ids must be a list of token ids, got {value!r}")
    return torch.tensor(sorted(set(value)), dtype=torch.long)


def chain_counts(tokens: torch.Tensor, stops: torch.Tensor) -> tuple[int, ...]:
    """Chains [B, N] int64 -> each row's length up to and including its first stop token (N if it has none)."""
    hit = torch.isin(tokens, stops.to(tokens.device))  # [B, N]
    return tuple(int(row.nonzero()[0]) + 1 if row.any() else tokens.shape[1] for row in hit)


def all_stopped(tokens: torch.Tensor, stops: torch.Tensor) -> bool:
    """Whether every chain [B, N] has drafted a stop token (drafting further could not be used)."""
    return bool(torch.isin(tokens, stops.to(tokens.device)).any(1).all())
