"""The drafting contexts of one request (IbED sec. 4-6): how each member sees the prompt's images.

    multimodal  every image token, read through the drafter's projector           (M)
    text        the images removed                                              (T)
    caption     each image replaced by the tokens of its caption                (C)
    pooled      each image's features average-pooled to a g_h x g_w grid         (P)

A member's context is its own token list (with its own positions) plus the visual feature rows of its image tokens,
in order. Images are cut from the prompt by count: image j is the image tokens after those of images 0 .. j-1, its
own T_j of them (the features' rows, ``drafters/image_runs.py``), so two images written back to back
(``<image><image>``) are still two images, and images of different sizes (Qwen2.5-VL) each keep their own count.

    members = parse_members(["multimodal", "text", {"kind": "pooled", "grid": 3, "weight": 2}])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.drafters.image_runs import image_lengths
from specula.drafters.massv_model import pool_features, pool_image, square_grid

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


def member_context(member: Member, prompt: Sequence[int], features, captions: Sequence[Sequence[int]] | None,
                   image_token_id: int) -> tuple[list[int], torch.Tensor | None]:
    """One member's context: (token ids, visual feature rows [n, D] for its n image tokens, or None).

    ``prompt``: the request's ids with image tokens expanded; ``features``: the target features of its images in
    order, one [T_img, D] tensor per image (a list; sizes may differ) or [N_img, T, D] (every image T tokens), None
    when it has none or for a member that does not read them; ``captions``: one token list per image (the caption
    member; images cut by the features' counts, else into equal parts, else one per run of image tokens).
    """
    n_img_tokens = sum(1 for t in prompt if t == image_token_id)
    if member.kind == "text" or n_img_tokens == 0:
        return [t for t in prompt if t != image_token_id], None
    images = None if features is None else list(features)  # each [T_img, D]
    if member.kind == "caption":
        if captions is None:
            raise ValueError("caption member: no captions given")
        lengths = _caption_lengths(prompt, image_token_id, images, len(captions), n_img_tokens)
    else:
        if images is None:
            raise ValueError(f"{member.name} member: the request has images but no features")
        lengths = [int(f.shape[0]) for f in images]
        if sum(lengths) != n_img_tokens:
            shapes = tuple(features.shape) if isinstance(features, torch.Tensor) else [tuple(f.shape) for f in images]
            raise ValueError(f"{member.name} member: {n_img_tokens} image tokens, features {shapes}")
    visual, emit = None, list(lengths)  # emit[j]: tokens that replace image j
    if member.kind == "multimodal":
        visual = (features.reshape(-1, features.shape[-1]) if isinstance(features, torch.Tensor)
                  else torch.cat(images))  # [sum T_img, D] row-major = the prompt's order
    elif member.kind == "pooled":
        visual = _pooled(features, images, member.grid)  # [N_img * g_h*g_w, D]
        emit = [member.grid[0] * member.grid[1]] * len(lengths)
    first = {s: j for j, s in enumerate(_starts(lengths))}  # image token index -> the image it opens
    tokens, k = [], 0
    for t in prompt:
        if t != image_token_id:
            tokens.append(int(t))
            continue
        j = first.get(k)
        if j is not None:  # the first token of image j: emit its replacement once
            tokens += [int(x) for x in captions[j]] if member.kind == "caption" else [image_token_id] * emit[j]
        k += 1
    return tokens, visual


def _starts(lengths: Sequence[int]) -> list[int]:
    """The index (among the prompt's image tokens) of each image's first token."""
    out, k = [], 0
    for t in lengths:
        out.append(k)
        k += t
    return out


def _caption_lengths(prompt, image_token_id: int, images, n_captions: int, n_img_tokens: int) -> list[int]:
    """Each image's token count for the caption member: from its features, else equal parts (every image the same
    size), else one image per run of image tokens (Qwen2.5-VL)."""
    if images is not None:
        lengths = [int(f.shape[0]) for f in images]
    elif n_captions and n_img_tokens % n_captions == 0:
        lengths = [n_img_tokens // n_captions] * n_captions
    else:
        lengths = list(image_lengths(torch.tensor(list(prompt)), image_token_id))
    if len(lengths) != n_captions or sum(lengths) != n_img_tokens:
        raise ValueError(f"caption member: {n_img_tokens} image tokens do not split into {n_captions} images")
    return lengths


def _pooled(features, images: list[torch.Tensor], grid: tuple[int, int]) -> torch.Tensor:
    """Every image pooled to ``grid``, rows in order [N_img * g_h*g_w, D]: one batched pooling when every image has
    the same count (the LLaVA path, as before), else image by image (``pool_image``)."""
    if isinstance(features, torch.Tensor) or len({f.shape[0] for f in images}) == 1:
        stacked = features if isinstance(features, torch.Tensor) else torch.stack(images)
        if square_grid(stacked.shape[1]):
            pooled = pool_features(stacked, grid)  # [N_img, g_h*g_w, D]
            return pooled.reshape(-1, pooled.shape[-1])
    return torch.cat([pool_image(f, grid) for f in images])
