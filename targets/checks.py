"""Input checks for prefill and verify: every bad input becomes a ValueError that names the request and the
problem, before any state changes."""

from __future__ import annotations

import torch

from .tree import chain_parents, check_parents
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


def check_block(block: DraftBlock, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host copies of a draft block: tokens [B, N] int64, parents [B, N] int64, counts [B] int64."""
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
        counts = torch.full((batch,), num_nodes, dtype=torch.long)  # [B] int64
    else:
        counts = torch.tensor([int(c) for c in block.counts], dtype=torch.long)  # [B] int64
        if counts.shape != (batch,) or bool(((counts < 0) | (counts > num_nodes)).any()):
            raise ValueError(f"draft counts {list(block.counts)} must give one count in [0, {num_nodes}] per row")
    if block.parents is None:
        parents = chain_parents(batch, num_nodes)  # [B, N] int64
    else:
        parents = block.parents.detach().to("cpu", torch.long)  # [B, N] int64
        if parents.shape != tokens.shape:
            raise ValueError(f"draft parents {tuple(parents.shape)} must match tokens {tuple(tokens.shape)}")
    check_parents(parents, counts)
    live = torch.arange(num_nodes)[None, :] < counts[:, None]  # [B, N] bool
    bad = live & ((tokens < 0) | (tokens >= vocab))  # [B, N] bool
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"draft block row {b} ({ids[b]!r}) node {i}: token id {int(tokens[b, i])} outside [0, {vocab})"
        )
    return tokens, parents, counts
