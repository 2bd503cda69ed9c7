"""The embedded target's processor: a stock ``LlavaProcessor`` over a PIL-only CLIP image processor.

transformers' default CLIP image processor wants torchvision, which cannot be installed beside this torch build;
``CLIPImageProcessorPil`` does the same resize / crop / normalise with PIL + numpy. Saving it records the PIL class,
so ``AutoProcessor.from_pretrained(dir)`` loads it back without torchvision.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoProcessor, LlavaProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

# The world's images are already 168 x 168; these are CLIP's usual statistics.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def build_processor(tokenizer, image_size: int = 168, patch_size: int = 14) -> LlavaProcessor:
    """A LlavaProcessor that expands each ``<image>`` into (image_size / patch_size)^2 image tokens."""
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=True,
        do_convert_rgb=True,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",  # drop CLS: 144 tokens for 168 px / patch 14
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def load_processor(path: str | Path):
    """Load a saved processor (embedded target or a real checkpoint) from a local directory."""
    return AutoProcessor.from_pretrained(str(path))
