"""The Target protocol: the only surface the runtime and the drafters use to talk to the target VLM.

A request's life::

    out = target.prefill([PrefillRequest("r1", ids, pixel_values)])   # prompt -> cache, out.logits [B, V]
    target.commit([Accept("r1", (), first_token)])                     # the sampled first token becomes pending
    while not done:
        v = target.verify(DraftBlock.chain(["r1"], drafts))           # v.logits [B, gamma + 1, V]
        target.commit([Accept.chain("r1", k, next_token)])            # cache = prefix + accepted
    target.release(["r1"])

Between ``verify`` and ``commit`` no other verify or prefill may run (``release`` may). Not thread-safe: one
caller drives one target.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from .types import Accept, DraftBlock, PrefillOutput, PrefillRequest, TargetInfo, VerifyOutput, VisualFeatures


@runtime_checkable
class Target(Protocol):
    @property
    def info(self) -> TargetInfo: ...

    @property
    def live_ids(self) -> tuple[str, ...]:
        """Request ids whose state is held, in batch order."""
        ...

    def encode_images(
        self,
        pixel_values: torch.Tensor,
        variant: str = "projected",
        *,
        grid: tuple[int, int] | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> VisualFeatures:
        """Vision tower (+ projector) on a batch of images; ``grid`` is required for ``variant="pooled"``."""
        ...

    def encode_image_variants(
        self,
        pixel_values: torch.Tensor,
        variants: Sequence[str],
        *,
        grid: tuple[int, int] | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> tuple[VisualFeatures, ...]:
        """``encode_images`` for several variants of the same images from one vision-tower pass, in order."""
        ...

    def prefill(self, requests: Sequence[PrefillRequest]) -> PrefillOutput:
        """Run new prompts and add them to the live batch (they may join rows already decoding)."""
        ...

    def verify(self, block: DraftBlock) -> VerifyOutput:
        """One batched forward over each row's pending token followed by its draft nodes."""
        ...

    def commit(self, accepts: Sequence[Accept]) -> None:
        """Keep the pending token and the accepted path in the cache; the next token becomes pending."""
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop rows and their cache."""
        ...

    def decode_step(self, request_ids: Sequence[str]) -> VerifyOutput:
        """Plain decoding: verify with no draft nodes; ``logits[:, 0]`` follows the pending token."""
        ...

    def generate_plain(
        self, requests: Sequence[PrefillRequest], max_new_tokens: int, eos_token_ids: Iterable[int] | None = None
    ) -> list[list[int]]:
        """Greedy reference decoding (no speculation); returns the new tokens per request, eos included."""
        ...

    def sequence(self, request_id: str) -> list[int]:
        """Prompt + committed tokens, pending token included (what a full recompute would be fed)."""
        ...
