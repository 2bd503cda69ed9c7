"""Qwen2.5-VL backend over stock ``Qwen2_5_VLForConditionalGeneration``.

Images: pixel_values are the processor's flattened patches [P, C*tp*p*p] with image_grid_thw [N_img, 3] (t, h, w in
patches); an image gives t*h*w / merge**2 visual tokens, row-major on the (h/merge, w/merge) grid. Videos are not
supported.

Positions (mrope): the prompt gets the stock ``get_rope_index`` positions [3, L] (text: three equal sections;
image tokens: t/h/w grid positions). Text after the prompt continues at ``max(prompt positions) + 1`` = L +
rope_delta in all three sections, which the engine tracks per row, so rollback never touches them.

Variants: "projected" = the merger output (what replaces the image tokens); "pre_projector" = the ViT's last
block output, put back in patch order and grouped by merge unit, [T_img, merge**2 * D_vis], i.e. exactly what the
merger's ``ln_q`` + MLP consume; "pooled" = projected features average-pooled on the token grid (t == 1 only).
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.vision_utils import get_vision_window_index

from .hf_target import HFTarget
from .images import check_variants, image_token_runs, pad_images, pool_grid
from .types import VisualFeatures


class Qwen2_5_VLTarget(HFTarget):
    model_type = "qwen2_5_vl"
    hf_class = Qwen2_5_VLForConditionalGeneration
    adjacent_images_ok = False  # every image is wrapped in vision_start / vision_end tokens
    rope_sections = 3

    def _vision_info(self) -> dict:
        cfg = self.model.config
        return {
            "image_token_id": cfg.image_token_id,
            "visual_tokens_per_image": None,
            "vision_hidden_size": cfg.vision_config.hidden_size,
        }

    def parameter_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        visual = self.model.model.visual
        return {
            "vision_tower": [p for n, p in visual.named_parameters() if not n.startswith("merger.")],
            "projector": list(visual.merger.parameters()),
            "language_model": [*self.model.model.language_model.parameters(), *self.model.lm_head.parameters()],
        }

    def dummy_image(self, generator: torch.Generator, side_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Random patches of one single-frame image with a side_tokens x side_tokens token grid (benchmarks)."""
        vc = self.model.config.vision_config
        side = side_tokens * vc.spatial_merge_size
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        return torch.randn(side * side, width, generator=generator), torch.tensor([[1, side, side]])

    def _check_grid(self, grid, request_id) -> torch.Tensor:
        merge = self.model.config.vision_config.spatial_merge_size
        if grid is None:
            raise ValueError(f"request {request_id!r}: Qwen2.5-VL needs image_grid_thw [N_img, 3] for its images")
        if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3:
            got = getattr(grid, "shape", grid)
            raise ValueError(f"request {request_id!r}: image_grid_thw must be [N_img, 3], got {got}")
        grid = grid.detach().to("cpu", torch.long)  # [N_img, 3] int64
        if bool((grid < 1).any()) or bool((grid[:, 1:] % merge != 0).any()):
            raise ValueError(
                f"request {request_id!r}: image_grid_thw {grid.tolist()} must be positive, h and w multiples of {merge}"
            )
        return grid

    def _image_tokens(self, pixel_values, grid, request_id) -> list[int]:
        vc = self.model.config.vision_config
        grid = self._check_grid(grid, request_id)
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        patches = int(grid.prod(dim=1).sum())
        if not isinstance(pixel_values, torch.Tensor) or tuple(pixel_values.shape) != (patches, width):
            got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise ValueError(
                f"request {request_id!r}: pixel_values must be flattened patches [{patches}, {width}] for "
                f"image_grid_thw {grid.tolist()}, got {got}"
            )
        return (grid.prod(dim=1) // vc.spatial_merge_size**2).tolist()

    @torch.no_grad()
    def encode_image_variants(self, pixel_values, variants, *, grid=None, image_grid_thw=None):
        """The module docstring's variants; one ViT pass serves every variant asked."""
        check_variants(variants, grid)
        tokens = self._image_tokens(pixel_values, image_grid_thw, "encode_images")
        thw = self._check_grid(image_grid_thw, "encode_images")
        if "pooled" in variants and bool((thw[:, 0] != 1).any()):
            raise ValueError("variant 'pooled' needs single-frame images (t == 1)")
        vc = self.model.config.vision_config
        merge = vc.spatial_merge_size
        g = thw.to(self.device)
        out = self.model.model.get_image_features(pixel_values.to(self.device), g, return_dict=True)
        results = []
        for variant in variants:
            if variant == "pre_projector":
                # The ViT runs in window order; the model un-permutes only after the merger. Do the same here.
                window_index, _ = get_vision_window_index(g, merge, vc.window_size, vc.patch_size)
                grouped = out.last_hidden_state.reshape(-1, merge * merge * vc.hidden_size)  # [sum T, merge²*D_vis]
                grouped = grouped[torch.argsort(window_index.to(self.device))]
                per_image = list(torch.split(grouped, tokens))  # each [T_i, merge²*D_vis]
            else:
                per_image = list(out.pooler_output)  # each [T_i, H]
            result = VisualFeatures(
                variant="projected" if variant == "pooled" else variant,
                features=pad_images(per_image),  # [N_img, T_max, D]
                lengths=tuple(tokens),
                grid_hw=tuple((int(h) // merge, int(w) // merge) for _, h, w in thw.tolist()),
                image_grid_thw=thw,
            )
            results.append(pool_grid(result, grid) if variant == "pooled" else result)
        return tuple(results)

    def _prompt_positions(self, prompt, grid, request_id):
        cfg = self.model.config
        if bool((prompt == cfg.video_token_id).any()):
            raise ValueError(f"request {request_id!r}: video tokens are not supported")
        runs = image_token_runs(prompt, cfg.image_token_id)
        if runs:
            grid = self._check_grid(grid, request_id)
            per_image = (grid.prod(dim=1) // cfg.vision_config.spatial_merge_size**2).tolist()
            if per_image != runs:
                raise ValueError(
                    f"request {request_id!r}: image_grid_thw {grid.tolist()} gives {per_image} visual tokens per "
                    f"image but the prompt's image-token groups are {runs}"
                )
        else:
            grid = None
        mm_types = (prompt == cfg.image_token_id).to(torch.int)[None]  # [1, L] 0 text, 1 image
        pos, _ = self.model.model.get_rope_index(prompt[None], mm_types, image_grid_thw=grid)  # [3, 1, L]
        return pos[:, 0], int(pos.max()) + 1  # [3, L] int64, next text position (= L + rope_delta)

    def _model_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos  # [3, B, T] int64 (temporal, height, width)
