"""The drafting contexts of one request (IbED sec. 4-6): how each member sees the prompt's images.

    multimodal  every image token, read through the drafter's projector           (M)
    text        the images removed                                              (T)
    caption     each image replaced by the tokens of its caption                (C)
    pooled      each image's features average-pooled to a g_h x g_w grid         (P)

A member's context is its own token list (with its own positions) plus the visual feature rows of its image tokens,
in order. Images are cut from the prompt by count (image j is image tokens j*T .. (j+1)*T - 1), so two images
written back to back (``<image><image>``) are still two images.

    members = parse_members(["multimodal", "text", {"kind": "pooled", "grid": 3, "weight": 2}])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.drafters.massv_model import pool_features

MEMBER_KINDS = ("multimodal", "text", "caption", "pooled")
DEFAULT_GRID = (6, 6)  # 144 -> 36 visual tokens per image


@dataclass(frozen=True)
class Member:
    kind: str  # one of MEMBER_KINDS
    weight: float = 1.0  # share in the mixture (normalized over the members)
    grid: tuple[int, int] | None = None  # pooled: tokens per image = g_h * g_w

    @property
    def sees_images(self) -> bool:
        """Whether the member needs the target's vision features (the caption member does, for its captioner)."""
        return self.kind != "text"

    @property
    def name(self) -> str:
        return f"pooled{self.grid[0] * self.grid[1]}" if self.kind == "pooled" else self.kind


def _grid(value, where: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise ValueError(f"{where}: grid must be an integer >= 1 or [g_h, g_w], got {value!r}")
    return int(value[0]), int(value[1])


def parse_members(members: Sequence, weights: Sequence[float] | None = None, grid=DEFAULT_GRID,
                  where: str = "ensemble") -> tuple[Member, ...]:
    """Members from config: each a kind name or ``{"kind", "weight", "grid"}``; ``weights`` (one per member)
    overrides the members' own; ``grid`` is the pooled members' default. Equal weights unless said otherwise."""
    if isinstance(members, (str, dict)) or not isinstance(members, Sequence) or not members:
        raise ValueError(f"{where}: members must be a non-empty list, got {members!r}")
    out = []
    for m in members:
        spec = {"kind": m} if isinstance(m, str) else m
        if not isinstance(spec, dict) or "kind" not in spec:
            raise ValueError(f"{where}: a member is a kind name or a dict with 'kind', got {m!r}")
        unknown = set(spec) - {"kind", "weight", "grid"}
        if unknown:
            raise ValueError(f"{where}: member {m!r} has unknown keys {sorted(unknown)}")
        kind = spec["kind"]
        if kind not in MEMBER_KINDS:
            raise ValueError(f"{where}: member kind must be one of {MEMBER_KINDS}, got {kind!r}")
        w = spec.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"{where}: member weight must be a finite number > 0, got {w!r}")
        if "grid" in spec and kind != "pooled":
            raise ValueError(f"{where}: only a pooled member takes a grid, got {m!r}")
        g = _grid(spec.get("grid", grid), where) if kind == "pooled" else None
        out.append(Member(kind, float(w), g))
    if weights is not None:
        if len(weights) != len(out):
            raise ValueError(f"{where}: {len(weights)} weights for {len(out)} members")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"{where}: weights must be finite numbers > 0, got {list(weights)}")
        out = [Member(m.kind, float(w), m.grid) for m, w in zip(out, weights)]
    if len({(m.kind, m.grid) for m in out}) != len(out):
        raise ValueError(f"{where}: a member is listed twice: {[m.name for m in out]}")
    return tuple(out)


def member_context(member: Member, prompt: Sequence[int], features: torch.Tensor | None,
                   captions: Sequence[Sequence[int]] | None, image_token_id: int
                   ) -> tuple[list[int], torch.Tensor | None]:
    """One member's context: (token ids, visual feature rows [n, D] for its n image tokens, or None).

    ``prompt``: the request's ids with image tokens expanded; ``features`` [N_img, T, D] the target features of its
    images in order (None when it has none, or for a member that does not read them); ``captions``: one token list
    per image (the caption member).
    """
    n_img_tokens = sum(1 for t in prompt if t == image_token_id)
    if member.kind == "text" or n_img_tokens == 0:
        return [t for t in prompt if t != image_token_id], None
    if member.kind == "caption":
        if captions is None:
            raise ValueError("caption member: no captions given")
        per = n_img_tokens // len(captions) if captions and n_img_tokens % len(captions) == 0 else 0
        if not per:
            raise ValueError(f"caption member: {n_img_tokens} image tokens do not split into {len(captions)} images")
    else:
        if features is None:
            raise ValueError(f"{member.name} member: the request has images but no features")
        per = features.shape[1]
        if features.shape[0] * per != n_img_tokens:
            raise ValueError(f"{member.name} member: {n_img_tokens} image tokens, features {tuple(features.shape)}")
    visual = None
    if member.kind == "multimodal":
        visual = features.reshape(-1, features.shape[-1])  # [N_img * T, D] row-major = the prompt's order
    elif member.kind == "pooled":
        pooled = pool_features(features, member.grid)  # [N_img, g_h*g_w, D]
        visual = pooled.reshape(-1, pooled.shape[-1])
    tokens, k = [], 0
    for t in prompt:
        if t != image_token_id:
            tokens.append(int(t))
            continue
        if k % per == 0:  # the first token of image j: emit its replacement once
            j = k // per
            if member.kind == "multimodal":
                tokens += [image_token_id] * per
            elif member.kind == "pooled":
                tokens += [image_token_id] * (member.grid[0] * member.grid[1])
            else:
                tokens += [int(x) for x in captions[j]]
        k += 1
    return tokens, visual
