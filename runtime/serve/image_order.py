"""Move a user message's images in front of its text, for targets that read an image only there.

LLaVA-style targets are trained on prompts that open with their image (``<image>What colour ...``). The embedded
target reads an image put anywhere else far worse (``specula zoo eval --suites vqa``: 0.91 with the image first,
0.02 with the question before it, 0.26 after a line of text; zoo/TRAINING.md), and the OpenAI API's usual message
is text part first, image part second. llava-hf's own chat templates render every image of a message before its
text for the same reason. Here a message is reordered only when its images form one run (``[text, image]``,
``[text, image, image, text]``): images interleaved with text (``Image 1: <image> Image 2: <image> ...``) keep their
places, since their labels name them. The images' relative order, and so the request's list of images, is
unchanged. Text parts that an image separated are joined with a space when neither side has one.

``model.image_parts_first`` in the config turns it on or off; null = on for LLaVA targets, off for Qwen2.5-VL
(trained on interleaved prompts).
"""

from __future__ import annotations


def image_parts_first(messages: list[dict]) -> list[dict]:
    """``messages`` (the processor's chat format) with each user message's single run of images moved first."""
    return [_reordered(m) if m.get("role") == "user" and isinstance(m.get("content"), list) else m
            for m in messages]


def _reordered(message: dict) -> dict:
    parts = message["content"]
    at = [i for i, p in enumerate(parts) if p.get("type") == "image"]
    if not at or at[0] == 0 or at[-1] - at[0] + 1 != len(at):  # no image, already first, or interleaved
        return message
    texts = [p for p in parts[: at[0]] if p.get("type") == "text"]
    after = [p for p in parts[at[-1] + 1:] if p.get("type") == "text"]
    if texts and after and not texts[-1]["text"][-1:].isspace() and not after[0]["text"][:1].isspace():
        texts[-1] = {**texts[-1], "text": texts[-1]["text"] + " "}
    return {**message, "content": [parts[i] for i in at] + texts + after}
