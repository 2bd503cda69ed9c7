"""A Conversation as chat messages for ``processor.apply_chat_template`` (Hugging Face content parts), each image
where its ``<image>`` marker was, and the (prompt, answer) exchanges drafter training is made of.

    >>> to_messages(conv)     # turns: "<image>\\nWhat is this?" / "A cat."
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]

A marker takes at most one newline on each side with it (LLaVA writes ``"<image>\\n..."``; the chat template puts
its own separator around an image part); all other text is kept exactly, so the embedded world's ``"<image>Q"`` and
``"Q <image>"`` render as the world writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specula.training.data.conversations import IMAGE_MARK, Conversation, DataError, _image_problem, _problem

_MARK = re.compile(r"\n?" + re.escape(IMAGE_MARK) + r"\n?")


@dataclass(frozen=True)
class Exchange:
    """One assistant turn of a conversation and everything before it."""

    messages: list[dict]  # the prompt: the turns before the answer (system, user and earlier answers), content parts
    answer: str  # the file's answer (``--answers data`` trains on it; self-distillation lets the target answer)
    n_images: int  # images in the prompt: ``load_images(conv)[:n_images]``
    turn: int  # the answer's index in ``conv.turns``


def content_parts(text: str) -> list[dict]:
    """``"a<image>\\nb"`` -> [text "a", image, text "b"]; empty text around a marker is dropped."""
    pieces = _MARK.split(text)
    parts: list[dict] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def to_messages(conv: Conversation, n_turns: int | None = None) -> list[dict]:
    """The first ``n_turns`` turns (all by default) as chat messages."""
    return [{"role": t.role, "content": content_parts(t.text)} for t in conv.turns[:n_turns]]


def exchanges(conv: Conversation) -> list[Exchange]:
    """One Exchange per assistant turn, in order: what self-distillation prompts the target with (it regenerates
    ``answer``) and what ``--answers data`` trains on (prompt + the file's answer)."""
    out, n_images = [], 0
    for k, t in enumerate(conv.turns):
        if t.role == "assistant":
            out.append(Exchange(to_messages(conv, k), t.text, n_images, k))
        n_images += t.text.count(IMAGE_MARK)
    return out


def load_images(conv: Conversation) -> list:
    """The conversation's images as RGB PIL images, in marker order; a file that cannot be read is a DataError that
    names the record (``validate(check_images=True)`` finds these before training)."""
    from PIL import Image

    images = []
    for p in conv.images:
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except Exception:  # noqa: BLE001 - PIL raises many kinds; the message says which
            raise DataError([_problem(conv, _image_problem(p) or f"image {p} cannot be read",
                                      "replace or re-download the file, or drop the record")]) from None
    return images
