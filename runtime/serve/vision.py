"""``VisionEngine``: pixels -> projected visual embeddings (the VisionEncoder deployment's engine; no Ray).

With ``pre_projector`` (config ``deployments.vision_encoder.pre_projector``) each result also carries the tower's
pre-projector features, for drafters with their own projector (massv, caption, pooled, ensemble).

The target consumes these in place of its image tokens (``GenerationRequest.visual``), so the vision tower can run
on its own device and batch images across requests::

    vision = VisionEngine(load_vision_target(path))        # only the vision tower + projector are resident
    feats = vision.encode(pixel_values)                    # VisualFeatures, features [N_img, T_img, H] on the CPU
    many = vision.encode_many([(pix_a, None), (pix_b, None)])   # one forward pass, one result per request

``from_config`` (what the VisionEncoder replica runs) loads only the vision side of the checkpoint
(``vision_weights.load_vision_target``): the language model stays on the meta device, so a vision replica's
memory is the vision tower's and the projector's. Results are on the CPU: they cross a process boundary next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.targets.types import VisualFeatures


class VisionEngine:
    """Wraps a Target's ``encode_image_variants`` ("projected", and "pre_projector" from the same tower pass) on a
    full Target or a vision-only one; thread-compatible, not thread-safe."""

    def __init__(self, target, pre_projector: bool = False) -> None:
        self.target = target
        self.pre_projector = pre_projector  # also return the tower's pre-projector features

    @classmethod
    def from_config(cls, config) -> VisionEngine:
        from specula.runtime.engine.factory import load_vision_target_for, set_threads

        settings = config.deployments.vision_encoder
        set_threads(settings)
        return cls(load_vision_target_for(config, settings.device), pre_projector=settings.pre_projector)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualFeatures:
        """One request's images -> projected features (``lengths`` tokens per image)."""
        return self.encode_many([(pixel_values, image_grid_thw)])[0]

    @torch.inference_mode()
    def encode_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> list[VisualFeatures]:
        """Several requests' images in one forward pass; one VisualFeatures per request, in order."""
        if not items:
            return []
        counts = [_num_images(p, g) for p, g in items]
        pixels = torch.cat([p for p, _ in items])  # LLaVA [sum N_img, 3, S, S]; Qwen [sum P, C*t*p*p]
        grids = [g for _, g in items]
        grid = torch.cat([torch.as_tensor(g) for g in grids]) if any(g is not None for g in grids) else None
        variants = ("projected", "pre_projector") if self.pre_projector else ("projected",)
        out, *rest = self.target.encode_image_variants(pixels, variants, image_grid_thw=grid)  # one tower pass
        pre = rest[0] if rest else None
        results, start = [], 0
        for n in counts:
            stop = start + n
            lengths = out.lengths[start:stop]
            width = max(lengths, default=0)
            results.append(VisualFeatures(
                variant=out.variant,
                features=out.features[start:stop, :width].cpu().contiguous(),  # [N_img, T_img, H]
                lengths=lengths,
                grid_hw=out.grid_hw[start:stop],
                image_grid_thw=None if out.image_grid_thw is None else out.image_grid_thw[start:stop].cpu(),
                pre_projector=None if pre is None else pre.features[start:stop, :max(pre.lengths[start:stop], default=0)]
                .cpu().contiguous(),  # [N_img, T_img, D_pre]
            ))
            start = stop
        return results


def _num_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> int:
    # LLaVA: one row per image; Qwen2.5-VL: pixel rows are patches, the grid has one row per image
    return int(pixel_values.shape[0]) if image_grid_thw is None else int(torch.as_tensor(image_grid_thw).shape[0])
