"""One way to turn a user prompt with images into model inputs: the chat template, then the processor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

from specula.world.tokenizer import format_turns


def encode_prompt(processor, prompt: str, images: Sequence[Image.Image] = (),
                  system: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``prompt`` holds one ``<image>`` per image; a non-empty ``system`` is a system turn before it. Returns
    (input_ids [L] int64, pixel_values [N_img, 3, S, S] | None)."""
    text = format_turns(prompt, system=system)
    if images:
        enc = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"][0], enc["pixel_values"]
    enc = processor.tokenizer([text], return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"][0], None
