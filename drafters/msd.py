"""``msd``: Multimodal Speculative Decoding (Lin et al. 2025), the EAGLE drafter with decoupled visual tokens.

The head (``drafters/msd_head.py``) reads, at each prompt position i,

    fc(concat(e(x_{i+1}), h_i))     when x_i is text (as ``eagle``)
    v_i                             when x_i is an image token: the raw projected visual embedding the target read

and predicts h_{i+1}; the target's lm_head turns a prediction into q. Everything after the prompt (the verdicts'
committed tokens, the draft nodes) is text, so drafting is ``eagle``'s (``drafters/eagle.py``): chain, EAGLE-2
dynamic trees for greedy rows, the lossless sampled tree (sibling groups fixed before their tokens are drawn, drawn
without replacement, never pruned; ``runtime/core/tree_rejection.py``) for sampled rows, the same batched cache.

``spec.needs`` = {"hidden", "visual"}: the engine passes the prompt's projected visual embeddings in
``DraftContext.visual`` [N_img, T_max, H], images in prompt order, tokens in row-major order (how the target
scatters them over the image tokens), padded to the longest image: each image's own count comes from the prompt
ids (``drafters/image_runs.py``: one run of image tokens per Qwen2.5-VL image, any size; LLaVA's fixed count).
With ``decoupled=False`` (the ablation, or a head trained without it) the drafter is ``eagle`` with the MSD
recipe's weights and does not ask for "visual".

Training: ``training/drafters/msd.py`` (stage 1 text-only, stage 2 the progressive text -> multimodal mix).

    drafter = create({"kind": "msd", "path": "msd", "structure": "tree", "top_k": 4, "depth": 5,
                      "total_tokens": 24}, target=target)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

from pathlib import Path

import torch

from specula.drafters.eagle import EagleDrafter
from specula.drafters.image_runs import feature_lengths, unpad
from specula.drafters.msd_head import MsdHead
from specula.drafters.protocol import DraftContext
from specula.drafters.registration import register


@register("msd")
class MsdDrafter(EagleDrafter):
    """Options: those of ``eagle`` (``path`` default "msd" or ``head`` an ``MsdHead``; ``structure``, ``top_k``,
    ``depth``, ``total_tokens``, ``seed``, ``device``, ``dtype``, ``kv_policy``), and ``decoupled`` (bool; default
    the head's ``MsdConfig.decoupled``, i.e. how it was trained). Resources: ``target``, ``tokenizer`` (unused)."""

    KIND = "msd"
    HEAD = MsdHead

    def __init__(self, path: str | Path | None = None, head: MsdHead | None = None, decoupled: bool | None = None,
                 **options):
        if decoupled is not None and not isinstance(decoupled, bool):
            raise ValueError(f"msd: decoupled must be a bool, got {decoupled!r}")
        self._decoupled = decoupled  # read by _needs during super().__init__
        info = getattr(options.get("target"), "info", None)
        self._image_tokens = getattr(info, "visual_tokens_per_image", None)  # LLaVA's fixed T; None: one per run
        super().__init__(path=path, head=head, **options)
        self.decoupled = self.head.config.decoupled if decoupled is None else decoupled

    def _needs(self) -> frozenset[str]:
        dec = self.head.config.decoupled if self._decoupled is None else self._decoupled
        return frozenset({"hidden", "visual"}) if dec else frozenset({"hidden"})

    def _check_context(self, c: DraftContext) -> None:
        if not self.decoupled or self.image_token_id is None:
            return
        n = int((c.prompt_ids == self.image_token_id).sum())
        if not n:
            return
        H = self.head.config.hidden_size
        got = None if c.visual is None else tuple(c.visual.shape)
        try:
            if c.visual is not None and c.visual.shape[-1] != H:
                raise ValueError(f"width {c.visual.shape[-1]} != H={H}")
            self._image_lengths(c)
        except ValueError as e:
            raise ValueError(f"msd.begin: {c.request_id!r} has {n} image tokens and needs their visual embeddings "
                             f"[N_img, T_max, H={H}] (one row per image, padded to the longest), got {got}: {e}"
                             ) from None

    def _image_lengths(self, c: DraftContext) -> tuple[int, ...]:
        """T_img of each image of the request (``image_runs.feature_lengths``)."""
        return feature_lengths(c.prompt_ids, self.image_token_id, c.visual, self._image_tokens)

    def _prompt_inputs(self, contexts: list[DraftContext], seq: int) -> dict:
        """visual [B, L, H] (the embedding of x_i where x_i is an image token, else 0), visual_mask [B, L] bool."""
        if not self.decoupled or self.image_token_id is None:
            return {"decoupled": False}
        b, H = len(contexts), self.head.config.hidden_size
        vis = torch.zeros(b, seq, H, dtype=self.dtype, device=self.device)  # [B, L, H]
        mask = torch.zeros(b, seq, dtype=torch.bool, device=self.device)  # [B, L]
        for i, c in enumerate(contexts):
            img = (c.prompt_ids == self.image_token_id).to(self.device)  # [L_i]
            if bool(img.any()):
                n = img.shape[0]
                mask[i, :n] = img
                rows = unpad(c.visual, self._image_lengths(c))  # [n_img_tokens, H] row-major = scatter order
                vis[i, :n][img] = rows.to(self.device, self.dtype)
        return {"visual": vis, "visual_mask": mask, "decoupled": True}
