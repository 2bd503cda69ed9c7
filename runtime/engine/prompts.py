"""The one prompt path: chat messages and images -> model inputs, by the checkpoint's own processor and chat template.

Every entry point builds its prompt here (``specula generate``, the benches, the reference answers, the serving front
doors), so each family gets its own format and the same question is the same tokens whichever door it came through:

    the embedded target   <s><|user|><image>What colour is the star?<|assistant|>         (zoo tokenizer's template)
    LLaVA-1.5             <s>USER: <image>\\nWhat colour is the star? ASSISTANT:          (llava-hf's template)
    Qwen2.5-VL            <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
                          <|vision_start|><|image_pad|><|vision_end|>What colour is the star?<|im_end|>\\n
                          <|im_start|>assistant\\n                                          (Qwen's template)

then the processor expands each image token (``<image>`` x 576 for LLaVA-1.5 at 336 px, ``<|image_pad|>`` x
``image_grid_thw.prod() / merge**2`` for Qwen2.5-VL) and returns the pixels (and Qwen's ``image_grid_thw``, which
its target needs for the mrope positions). Special tokens follow transformers' processor rule: the tokenizer adds
its own (LLaVA's ``<s>``) unless the rendered prompt already starts with the BOS token.

World samples write one ``<image>`` mark per image in their prompt text (``specula.world.sample.IMAGE_MARK``); those
marks become image content parts (``prompt_messages``), so the checkpoint's template decides how an image is
spelled. Message contents may be a string or a list of ``{"type": "text", "text"}`` / ``{"type": "image"}`` parts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from specula.world.sample import IMAGE_MARK


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as the target takes it. Unpacks as ``ids, pix = encoded`` (LLaVA callers); Qwen2.5-VL's grid is
    ``image_grid_thw``, which ``request`` / ``prefill`` carry along."""

    input_ids: torch.Tensor  # [L] int64, image tokens expanded
    pixel_values: torch.Tensor | None = None  # LLaVA [N_img, 3, S, S]; Qwen2.5-VL [P, C*tp*p*p] patches
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] int64, Qwen2.5-VL only
    mm_token_type_ids: torch.Tensor | None = None  # [L] int, 1 at image tokens; Qwen2.5-VL only (HF's mrope)

    def __iter__(self) -> Iterator:
        return iter((self.input_ids, self.pixel_values))

    def request(self, request_id: str, params=None, **kw):
        """A ``GenerationRequest`` of this prompt (``kw``: its other fields, e.g. ``drafter``)."""
        from specula.runtime.engine.loop import GenerationRequest

        if params is not None:
            kw["params"] = params
        return GenerationRequest(request_id, self.input_ids, self.pixel_values, image_grid_thw=self.image_grid_thw,
                                 **kw)

    def hf_inputs(self, device="cpu") -> dict:
        """Keyword arguments for the stock HF model's ``generate`` / ``forward`` on this prompt (batch of 1)."""
        out = {"input_ids": self.input_ids[None], "pixel_values": self.pixel_values,
               "image_grid_thw": self.image_grid_thw,
               "mm_token_type_ids": None if self.mm_token_type_ids is None else self.mm_token_type_ids[None]}
        return {k: v.to(device) for k, v in out.items() if v is not None}

    def prefill(self, request_id: str):
        """A ``PrefillRequest`` of this prompt (the Target protocol's)."""
        from specula.targets.types import PrefillRequest

        return PrefillRequest(request_id, self.input_ids, self.pixel_values, self.image_grid_thw)


def marked_parts(text: str, mark: str = IMAGE_MARK) -> list[dict]:
    """``"<image>Describe it."`` -> ``[{"type": "image"}, {"type": "text", "text": "Describe it."}]``: one image part
    per ``mark``, in place; empty text between marks is left out."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(mark)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def prompt_messages(prompt: str, n_images: int = 0, system: str = "", mark: str = IMAGE_MARK) -> list[dict]:
    """One user turn (after a system turn when ``system`` is not empty). ``prompt`` places its images with ``mark``
    (one per image); a prompt with no mark gets its ``n_images`` images in front of its text."""
    count = prompt.count(mark)
    if count and count != n_images:
        raise ValueError(f"the prompt has {count} {mark!r} marks for {n_images} images; put one per image, or none "
                         "(the images then go before the text)")
    parts = marked_parts(prompt, mark) if count else [{"type": "image"}] * n_images + marked_parts(prompt, mark)
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    return messages + [{"role": "user", "content": parts}]


def _as_parts(messages: Sequence[dict]) -> list[dict]:
    # String contents as one text part: llava-hf's template iterates over parts and would drop a plain string.
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def render(processor, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The checkpoint's chat template applied to ``messages`` (text, image tokens not yet expanded)."""
    return processor.apply_chat_template(_as_parts(messages), add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def encode_messages(processor, messages: Sequence[dict], images: Sequence = ()) -> EncodedPrompt:
    """``messages`` (one ``{"type": "image"}`` part per entry of ``images``, in order) through the chat template and
    the processor. ``images``: PIL images (or anything the processor takes)."""
    text = render(processor, messages)
    tok = processor.tokenizer
    special = not (tok.bos_token is not None and text.startswith(tok.bos_token))
    if images:
        enc = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=special)
    else:
        enc = tok([text], return_tensors="pt", add_special_tokens=special)
    mm = enc.get("mm_token_type_ids") if enc.get("image_grid_thw") is not None else None
    return EncodedPrompt(enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw"),
                         None if mm is None else mm[0])


def encode_prompt(processor, prompt: str, images: Sequence = (), system: str = "") -> EncodedPrompt:
    """A world-style prompt (one ``<image>`` mark per image, or none: images first) and its images; a non-empty
    ``system`` is a system turn before it. ``ids, pix = encode_prompt(...)`` still works; see ``EncodedPrompt``."""
    return encode_messages(processor, prompt_messages(prompt, len(images), system), images)


def eos_ids(tokenizer, target=None) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS, then the checkpoint's generation_config ones
    (``target.info.eos_token_ids``; Qwen2.5-VL's are ``<|im_end|>`` and ``<|endoftext|>``)."""
    out = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for t in (target.info.eos_token_ids if target is not None else ()):
        if t not in out:
            out.append(int(t))
    return out
