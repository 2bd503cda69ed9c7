"""``pooled``: multimodal drafting on pooled visual tokens (IbED sec. 5.1): each image's target features are
average-pooled on its token grid to ``grid`` (144 = 12 x 12 -> 6 x 6 = 36, 3 x 3 = 9, 1 x 1 = 1) *before* the
drafter's projector, so the drafter's context holds g_h * g_w visual tokens per image instead of 144. Same model
as ``massv`` (``drafters/massv_model.py``); the ``ensemble`` drafter with one pooled member.

    drafter = create({"kind": "pooled", "path": "massv", "grid": 3}, target=target)   # 9 tokens per image
"""

from __future__ import annotations

from specula.drafters.ensemble import EnsembleDrafter
from specula.drafters.ensemble_members import DEFAULT_GRID
from specula.drafters.registration import register


@register("pooled")
class PooledDrafter(EnsembleDrafter):
    """Options: ``grid`` (an int side or [g_h, g_w], default 6 -> 36 tokens per image) and those of ``massv``."""

    KIND = "pooled"
    DEFAULT_MEMBERS = ("pooled",)

    def __init__(self, grid=DEFAULT_GRID, target=None, tokenizer=None, vocab_size: int | None = None,
                 image_token_id: int | None = None, device: str | None = None, **options):
        fixed = {"members", "weights", "captioner", "caption_max_tokens", "caption_cache"} & set(options)
        if fixed:
            raise ValueError(f"pooled: unknown options {sorted(fixed)} (pooled has one pooled member)")
        super().__init__(grid=grid, **options, target=target, tokenizer=tokenizer, vocab_size=vocab_size,
                         image_token_id=image_token_id, device=device)
