"""Tiny random LLaVA and Qwen2.5-VL targets (fp32, CPU) and prompt builders for the target tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from specula.targets import PrefillRequest, load_target

LLAVA_IMAGE = 99
QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 120, 121, 122, 123


def tiny_llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=28, patch_size=14, projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE, image_seq_length=4)
    return LlavaForConditionalGeneration(cfg).eval()


def tiny_qwen() -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    text = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO,
        vision_start_token_id=QWEN_START, vision_end_token_id=QWEN_END,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


@dataclass
class Kit:
    """One backend: the stock model, a prompt maker and a full-recompute reference."""

    name: str
    model: torch.nn.Module

    def target(self, **kw):
        return load_target(self.model, device="cpu", **kw)

    def request(self, rid: str, text_lens: list[int], sizes: list[int], seed: int) -> PrefillRequest:
        """A prompt of text runs with one image between consecutive runs; ``sizes`` picks each image's shape
        (LLaVA: ignored, every image is 28x28; Qwen: image i is 16 px high and 16 or 24 px wide)."""
        g = torch.Generator().manual_seed(seed)
        pieces, images, grids = [], [], []
        for i, n in enumerate(text_lens):
            pieces.append(torch.randint(3, 90, (n,), generator=g))
            if i < len(sizes):
                if self.name == "llava":
                    pieces.append(torch.full((4,), LLAVA_IMAGE))
                    images.append(torch.randn(1, 3, 28, 28, generator=g))
                else:
                    w = 4 if sizes[i] == 0 else 6
                    pieces.append(torch.tensor([QWEN_START] + [QWEN_IMAGE] * w + [QWEN_END]))
                    images.append(torch.randn(4 * w, 3 * 2 * 4 * 4, generator=g))
                    grids.append([1, 4, w])
        ids = torch.cat(pieces)
        if not images:
            return PrefillRequest(rid, ids)
        pixels = torch.cat(images)
        grid = torch.tensor(grids) if grids else None
        return PrefillRequest(rid, ids, pixel_values=pixels, image_grid_thw=grid)

    @torch.no_grad()
    def recompute(self, req: PrefillRequest, sequence: list[int], hidden_layers=None):
        """Stock full forward of ``sequence`` (prompt + continuation) with the request's images."""
        ids = torch.tensor(sequence)[None]
        kw = {}
        if req.pixel_values is not None:
            kw["pixel_values"] = req.pixel_values
        if self.name == "qwen2_5_vl":
            self.model.model.rope_deltas = None
            kw["mm_token_type_ids"] = (ids == QWEN_IMAGE).int()
            if req.image_grid_thw is not None:
                kw["image_grid_thw"] = req.image_grid_thw
        if hidden_layers is not None:
            kw["output_hidden_states"] = True
        return self.model(input_ids=ids, use_cache=True, **kw)


_MODELS = {}


def _kit(name: str) -> Kit:
    if name not in _MODELS:
        _MODELS[name] = tiny_llava() if name == "llava" else tiny_qwen()
    return Kit(name, _MODELS[name])


@pytest.fixture(params=["llava", "qwen2_5_vl"])
def kit(request) -> Kit:
    return _kit(request.param)


@pytest.fixture
def llava_kit() -> Kit:
    return _kit("llava")


@pytest.fixture
def qwen_kit() -> Kit:
    return _kit("qwen2_5_vl")


