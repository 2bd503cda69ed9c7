"""Numbering the images of a set in the prompt ("Image 1: <image> Image 2: <image> ...").

A decoder LM sees a set's images as runs of identical placeholder positions; with bare ``<image><image><image>`` nothing
in the tokens says where the second image starts, so "the object in the second image" has no handle. Chat templates
of real VLMs number the images (Qwen2-VL's ``add_vision_id``: "Picture 1: ..."; InternVL's "Image-1: ..."). A processor
with ``number_images`` on does the same for every prompt of two or more images: each placeholder that is not already
preceded by its own ``Image n:`` marker gets one, so ``<image><image> q`` and ``Image 1: <image> Image 2: <image> q``
reach the model as the same words. Prompts with one image are left alone.
"""

from __future__ import annotations

import re


def number_image_marks(text: str, token: str = "<image>") -> str:
    """``text`` with ``Image n: `` before the n-th ``token`` wherever it is missing, when there are two or more."""
    parts = text.split(token)
    if len(parts) < 3:  # fewer than two images
        return text
    out = parts[0]
    for n, after in enumerate(parts[1:], start=1):
        if re.search(rf"Image {n}:\s*$", out) is None:
            sep = "" if out == "" or out[-1].isspace() else " "
            out += f"{sep}Image {n}: "
        out += token + after
    return out
