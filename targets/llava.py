"""LLaVA backend over stock ``LlavaForConditionalGeneration`` (LLaVA-1.5 and the tiny embedded target).

Images: pixel_values [N_img, 3, S, S] at the vision tower's image_size (a processor resizes/crops). Every image
gives the same number of visual tokens. Positions are plain 1-D text positions.
"""

from __future__ import annotations

import torch
from transformers import LlavaForConditionalGeneration

from .hf_target import HFTarget
from .images import check_variants, pool_grid
from .types import VisualFeatures


class LlavaTarget(HFTarget):
    model_type = "llava"
    hf_class = LlavaForConditionalGeneration
    adjacent_images_ok = True  # "<image><image>" expands into one run of image tokens
    rope_sections = 1

    def _vision_info(self) -> dict:
        cfg = self.model.config
        return {
            "image_token_id": cfg.image_token_id,
            "visual_tokens_per_image": self._tokens_per_image(),
            "vision_hidden_size": cfg.vision_config.hidden_size,
        }

    def parameter_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        m = self.model
        return {
            "vision_tower": list(m.model.vision_tower.parameters()),
            "projector": list(m.model.multi_modal_projector.parameters()),
            "language_model": list(m.model.language_model.parameters()) + list(m.lm_head.parameters()),
        }

    def dummy_image(self, generator: torch.Generator) -> tuple[torch.Tensor, None]:
        """Random pixels of the right shape (benchmarks): [1, 3, S, S]."""
        vc = self.model.config.vision_config
        return torch.randn(1, vc.num_channels, vc.image_size, vc.image_size, generator=generator), None

    def _grid_side(self) -> int:
        vc = self.model.config.vision_config
        return vc.image_size // vc.patch_size

    def _tokens_per_image(self) -> int:
        tower = self.model.model.vision_tower
        embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
        # CLIP prepends a CLS position (num_positions = patches + 1); "default" drops the first token as HF does.
        positions = getattr(embeddings, "num_positions", self._grid_side() ** 2 + 1)
        return positions - 1 if self.model.config.vision_feature_select_strategy == "default" else positions

    def _image_tokens(self, pixel_values, grid, request_id) -> list[int]:
        if grid is not None:
            raise ValueError(f"request {request_id!r}: image_grid_thw is for Qwen2.5-VL, not LLaVA")
        vc = self.model.config.vision_config
        want = (vc.num_channels, vc.image_size, vc.image_size)
        ok = isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 4
        if not ok or tuple(pixel_values.shape[1:]) != want:
            got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise ValueError(
                f"request {request_id!r}: pixel_values must be [N_img, {', '.join(map(str, want))}], got {got}"
            )
        return [self._tokens_per_image()] * pixel_values.shape[0]

    @torch.no_grad()
    def encode_image_variants(self, pixel_values, variants, *, grid=None, image_grid_thw=None):
        """LLaVA: "projected" [N_img, T_img, H]; "pre_projector" [N_img, T_img, D_vis * n_feature_layers] (the vision
        tower hidden states at ``vision_feature_layer``, CLS dropped for the "default" strategy, concatenated over a
        layer list); "pooled" [N_img, g_h*g_w, H]. One tower pass serves every variant asked."""
        check_variants(variants, grid)
        tokens = self._image_tokens(pixel_values, image_grid_thw, "encode_images")
        cfg = self.model.config
        pixels = pixel_values.to(self.device, self.dtype)  # [N_img, 3, S, S]
        out = self.model.model.get_image_features(pixel_values=pixels, return_dict=True)
        side = self._grid_side()
        results = []
        for variant in variants:
            if variant == "pre_projector":
                layers = cfg.vision_feature_layer
                layers = [layers] if isinstance(layers, int) else list(layers)
                picked = [out.hidden_states[i] for i in layers]  # each [N_img, 1 + side*side, D_vis]
                if cfg.vision_feature_select_strategy == "default":
                    picked = [h[:, 1:] for h in picked]
                feats = torch.cat(picked, dim=-1)  # [N_img, T_img, D_vis * len(layers)]
            else:
                feats = torch.stack(list(out.pooler_output))  # [N_img, T_img, H]
            result = VisualFeatures(
                variant="projected" if variant == "pooled" else variant,
                features=feats,
                lengths=tuple(tokens),
                grid_hw=((side, side),) * len(tokens),
            )
            results.append(pool_grid(result, grid) if variant == "pooled" else result)
        return tuple(results)

    def _prompt_positions(self, prompt, grid, request_id):
        if grid is not None:
            raise ValueError(f"request {request_id!r}: image_grid_thw is for Qwen2.5-VL, not LLaVA")
        length = prompt.shape[0]
        return torch.arange(length, dtype=torch.long)[None], length  # [1, L] int64, next position

    def _model_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos[0]  # [B, T] int64
