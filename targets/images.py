"""Backend-independent image helpers: matching image-token groups to images, and grid pooling."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .types import VARIANTS, VisualFeatures


def image_token_runs(input_ids: torch.Tensor, image_token_id: int) -> list[int]:
    """Lengths of the maximal runs of ``image_token_id`` in a 1-D prompt, in order."""
    runs: list[int] = []
    prev = False
    for tok in input_ids.tolist():
        cur = tok == image_token_id
        if cur and prev:
            runs[-1] += 1
        elif cur:
            runs.append(1)
        prev = cur
    return runs


def check_image_groups(
    input_ids: torch.Tensor,
    image_token_id: int,
    tokens_per_image: Sequence[int],
    *,
    request_id: str,
    adjacent_ok: bool,
) -> None:
    """ValueError unless the prompt's image-token groups line up with the images, in order.

    Each run of image tokens must hold one image (``adjacent_ok=False``, Qwen2.5-VL: images are always wrapped in
    vision-start/end tokens) or a whole number of consecutive images (``adjacent_ok=True``, LLaVA: ``<image><image>``
    expands into one run).
    """
    runs = image_token_runs(input_ids, image_token_id)
    summary = (
        f"request {request_id!r}: prompt has {len(runs)} image-token group(s) of sizes {runs} but "
        f"{len(tokens_per_image)} image(s) of {list(tokens_per_image)} visual tokens"
    )
    if not adjacent_ok:
        if list(runs) != list(tokens_per_image):
            raise ValueError(summary)
        return
    i = 0
    for run in runs:
        filled = 0
        while filled < run and i < len(tokens_per_image):
            filled += tokens_per_image[i]
            i += 1
        if filled != run:
            raise ValueError(summary)
    if i != len(tokens_per_image):
        raise ValueError(summary)


def check_variants(variants: Sequence[str], grid: tuple[int, int] | None) -> None:
    """encode_images' argument checks: known variant names, at least one, and a grid for "pooled"."""
    if isinstance(variants, str) or not variants:
        raise ValueError(f"variants must be a non-empty sequence of names from {VARIANTS}, got {variants!r}")
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if "pooled" in variants and grid is None:
        raise ValueError("variant 'pooled' needs grid=(g_h, g_w)")


def pool_grid(features: VisualFeatures, grid: tuple[int, int]) -> VisualFeatures:
    """Average-pool projected features on each image's 2-D token grid to ``grid`` = (g_h, g_w) tokens.

    Uses adaptive average pooling, so a grid that does not divide the token grid gets overlapping windows. A
    leading CLS token (LLaVA with ``vision_feature_select_strategy="full"``) is dropped before pooling.
    """
    gh, gw = grid
    if gh < 1 or gw < 1:
        raise ValueError(f"pooled grid must be positive, got {grid}")
    pooled = []
    for feats, (rows, cols) in zip(features.per_image(), features.grid_hw, strict=True):
        patches = feats[-rows * cols :]  # [rows*cols, D], CLS dropped if present
        img = patches.T.reshape(1, -1, rows, cols)  # [1, D, rows, cols]
        out = F.adaptive_avg_pool2d(img.float(), (gh, gw)).to(feats.dtype)  # [1, D, gh, gw]
        pooled.append(out.reshape(-1, gh * gw).T)  # [gh*gw, D]
    stacked = torch.stack(pooled) if pooled else features.features[:, :0]  # [N_img, gh*gw, D]
    return VisualFeatures(
        variant="pooled",
        features=stacked,
        lengths=tuple(gh * gw for _ in pooled),
        grid_hw=tuple((gh, gw) for _ in pooled),
        image_grid_thw=features.image_grid_thw,
    )


def pad_images(per_image: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack [T_i, D] tensors into [N_img, T_max, D], zero-padded."""
    t_max = max(x.shape[0] for x in per_image)
    out = per_image[0].new_zeros(len(per_image), t_max, per_image[0].shape[-1])  # [N_img, T_max, D]
    for i, x in enumerate(per_image):
        out[i, : x.shape[0]] = x
    return out
