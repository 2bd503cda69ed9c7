"""Tiny random LLaVA and Qwen2.5-VL models (fp32, CPU) shared by the target tests.

A uniquely named module, so test files import it directly (``from conftest import`` resolves to whichever
conftest.py pytest loaded last, which depends on collection order)."""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

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
