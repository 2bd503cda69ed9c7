"""Where each image of a prompt lies, and its own rows of padded features: shared by the drafters that read images
(``massv`` / ``ensemble`` and their members, ``msd``, ``flash``; training ``flash`` too).

The engine hands a drafter the target's visual features padded to the longest image, ``[N_img, T_max, D]``, rows
past an image's own ``T_img`` zero (``VisualFeatures.features``; its ``lengths`` do not travel, neither in process
nor over the gRPC data plane). A drafter reads each image's ``T_img`` from the prompt ids instead:

  Qwen2.5-VL   every image is its own run of image-pad tokens (between ``<|vision_start|>`` .. ``<|vision_end|>``)
               and runs never touch: one run = one image, ``T_img`` = the run's length (any image size)
  LLaVA        every image has the same fixed ``T`` (``TargetInfo.visual_tokens_per_image``) and runs may touch
               (``<image><image>``): a run of ``k * T`` tokens is ``k`` images

``image_lengths(ids, image_token_id, fixed)`` is that rule (``fixed`` = T, or None: one image per run).
``feature_lengths`` applies it to features given with a prompt: with no ``fixed`` known, ``N_img * T_max`` equal to
the prompt's image tokens (and every run a whole number of ``T_max``-token images) means every image has ``T_max``
tokens (the LLaVA case, or same-size Qwen images: the old, unpadded reading), anything else one image per run, each
at most ``T_max``. ``unpad`` / ``per_image`` drop
the padding in prompt order (row-major per image: the order the target scatters features over its image tokens).

    lengths = feature_lengths(ids, image_token_id, feats)     # (8, 12) for two Qwen images padded to [2, 12, D]
    rows = unpad(feats, lengths)                               # [20, D], the prompt's image tokens in order
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_runs(ids, image_token_id: int | None) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of ``image_token_id`` in ids [L] (a tensor or a list), in order."""
    ids = torch.as_tensor(ids).cpu()
    if image_token_id is None or not ids.numel():
        return []
    img = (ids == image_token_id).to(torch.int8)  # [L]
    edge = torch.diff(img, prepend=img.new_zeros(1), append=img.new_zeros(1))  # [L + 1]: +1 opens, -1 closes
    starts = torch.nonzero(edge == 1).flatten().tolist()
    ends = torch.nonzero(edge == -1).flatten().tolist()
    return [(s, e - s) for s, e in zip(starts, ends)]


def image_lengths(ids, image_token_id: int | None, fixed: int | None = None) -> tuple[int, ...]:
    """T_img of each image of the prompt ids [L], in order: ``fixed`` tokens each (every run a whole number of
    images; LLaVA), or with ``fixed`` None one image per run (Qwen2.5-VL). Raises ValueError on a run that is not
    whole images."""
    runs = image_runs(ids, image_token_id)
    if fixed is None:
        return tuple(n for _, n in runs)
    if isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1:
        raise ValueError(f"tokens per image must be an integer >= 1 or None, got {fixed!r}")
    bad = [(s, n) for s, n in runs if n % fixed]
    if bad:
        s, n = bad[0]
        raise ValueError(f"the image run at position {s} has {n} tokens: not a whole number of {fixed}-token images")
    return (fixed,) * (sum(n for _, n in runs) // fixed)


def image_starts(ids, image_token_id: int | None, lengths: Sequence[int]) -> torch.Tensor:
    """The position of each image's first token [N_img] int64, for ``lengths`` from ``image_lengths``."""
    ids = torch.as_tensor(ids).cpu()
    pos = torch.nonzero(ids == image_token_id).flatten() if image_token_id is not None else ids.new_zeros(0)  # [n]
    if sum(lengths) != pos.numel():
        raise ValueError(f"{pos.numel()} image tokens in the prompt, images of {tuple(lengths)} tokens")
    first = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0) if lengths else pos.new_zeros(0)
    return pos[first]


def feature_lengths(ids, image_token_id: int | None, features: torch.Tensor | None,
                    fixed: int | None = None) -> tuple[int, ...]:
    """T_img of each image of the prompt ids [L] given its padded features [N_img, T_max, D] (module docstring);
    ``fixed``: the target's tokens per image when known (LLaVA). () for a prompt without image tokens. Raises
    ValueError naming what does not fit: no features, not 3-d, another image count, an image longer than T_max."""
    n = int((torch.as_tensor(ids) == image_token_id).sum()) if image_token_id is not None else 0
    if not n:
        return ()
    if features is None or features.dim() != 3:
        got = None if features is None else tuple(features.shape)
        raise ValueError(f"features must be [N_img, T_max, D], got {got}")
    n_img, t_max = int(features.shape[0]), int(features.shape[1])
    if fixed is not None:
        lengths = image_lengths(ids, image_token_id, fixed)
    else:
        lengths = image_lengths(ids, image_token_id)  # one image per run
        if n_img * t_max == n and all(t % t_max == 0 for t in lengths):
            lengths = (t_max,) * n_img  # every image has T_max tokens (runs may touch)
    if len(lengths) != n_img or max(lengths) > t_max:
        raise ValueError(f"the prompt's {n} image tokens are {len(lengths)} image(s) of {lengths} tokens; features "
                         f"{tuple(features.shape)} hold {n_img} image(s) of at most {t_max}")
    return lengths


def unpad(features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Padded features [N_img, T_max, D] -> each image's own rows [sum T_img, D], images in order."""
    if all(t == features.shape[1] for t in lengths) and len(lengths) == features.shape[0]:
        return features.reshape(-1, features.shape[-1])  # nothing padded: the plain row-major view
    return torch.cat([features[j, :t] for j, t in enumerate(lengths)]) if lengths else features[:0, 0]


def per_image(features: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Padded features [N_img, T_max, D] -> one [T_img, D] tensor per image."""
    return [features[j, :t] for j, t in enumerate(lengths)]
