"""Input checks for prefill and verify: every bad input becomes a ValueError that names the request and the
problem, before any state changes."""

from __future__ import annotations

import torch

from .tree import check_parents
from .types import DraftBlock, PrefillRequest, VisualFeatures


def check_prompt(r: PrefillRequest, vocab: int) -> torch.Tensor:
    """The prompt as a host [L] int64 tensor."""
    ids = r.input_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point:
        raise ValueError(f"request {r.request_id!r}: input_ids must be a 1-D integer tensor")
    if ids.numel() == 0:
        raise ValueError(f"request {r.request_id!r}: empty prompt")
    ids = ids.detach().to("cpu", torch.long)  # [L] int64
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        raise ValueError(f"request {r.request_id!r}: token id {int(ids[bad][0])} outside [0, {vocab})")
    return ids


def check_visual(visual, request_id: str, hidden_size: int) -> list[torch.Tensor]:
    """Precomputed projected features as one [T_img, H] tensor per image."""
    if isinstance(visual, VisualFeatures):
        if visual.variant != "projected":
            raise ValueError(
                f"request {request_id!r}: the target consumes 'projected' features, got {visual.variant!r}"
            )
        images = visual.per_image()
    elif isinstance(visual, torch.Tensor) and visual.dim() == 3:
        images = list(visual)
    else:
        raise ValueError(f"request {request_id!r}: visual must be VisualFeatures or a [N_img, T_img, H] tensor")
    for x in images:
        if x.shape[-1] != hidden_size:
            raise ValueError(
                f"request {request_id!r}: visual features have width {x.shape[-1]}, the language model expects "
                f"{hidden_size}"
            )
    return images


def check_block(block: DraftBlock, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Host copies of a draft block: tokens [B, N] int64, parents [B, N] int64 (None for a chain), counts (B ints)."""
    ids = tuple(block.request_ids)
    if not ids:
        raise ValueError("draft block has no rows")
    if len(set(ids)) != len(ids):
        raise ValueError(f"draft block lists a request more than once: {list(ids)}")
    t = block.tokens
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != len(ids) or t.dtype.is_floating_point:
        raise ValueError(f"draft tokens must be an integer tensor [B={len(ids)}, N], got {getattr(t, 'shape', t)}")
    tokens = t.detach().to("cpu", torch.long)  # [B, N] int64
    batch, num_nodes = tokens.shape
    if block.counts is None:
        counts = [num_nodes] * batch
    else:
        counts = [int(c) for c in block.counts]
        if len(counts) != batch or any(not 0 <= c <= num_nodes for c in counts):
            raise ValueError(f"draft counts {list(block.counts)} must give one count in [0, {num_nodes}] per row")
    parents = None  # a chain: node i hangs off node i - 1, valid by construction
    if block.parents is not None:
        parents = block.parents.detach().to("cpu", torch.long)  # [B, N] int64
        if parents.shape != tokens.shape:
            raise ValueError(f"draft parents {tuple(parents.shape)} must match tokens {tuple(tokens.shape)}")
        check_parents(parents, torch.tensor(counts, dtype=torch.long))
    if num_nodes == 0:
        return tokens, parents, counts  # plain decoding step: no tokens to check
    live = tokens  # [B, N] int64; padding past a row's count is ignored
    if any(c < num_nodes for c in counts):
        live = torch.where(torch.arange(num_nodes)[None, :] < torch.tensor(counts)[:, None], tokens, 0)
    lo, hi = live.aminmax()
    if int(lo) < 0 or int(hi) >= vocab:
        b, i = (int(x) for x in ((live < 0) | (live >= vocab)).nonzero()[0])
        raise ValueError(
            f"draft block row {b} ({ids[b]!r}) node {i}: token id {int(tokens[b, i])} outside [0, {vocab})"
        )
    return tokens, parents, counts
