"""The checks a conversation file alone cannot answer, all run before training: every image opens, and no turn or
conversation is longer than the target's token limit. ``load_conversations`` is what a trainer calls first: the file's
rules and these checks, with one DataError listing every problem.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from specula.training.data.conversations import (IMAGE_MARK, MAX_SHOWN, Conversation, Problem, _image_problem,
                                                 _problem, _Problems, _read)
from specula.training.data.messages import to_messages


def check_images(conversations: Sequence[Conversation], *, threads: int = 8, progress: bool = True) -> list[Problem]:
    """Opens every image's header (each distinct file once, ``threads`` at a time)."""
    unique = list(dict.fromkeys(p for c in conversations for p in c.images))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        found = dict(zip(unique, tqdm(pool.map(_image_problem, unique), total=len(unique), desc="checking images",
                                      unit="image", leave=False, mininterval=2.0, disable=not progress)))
    return [_problem(c, msg, "replace or re-download the file, or drop the record")
            for c in conversations for p in c.images if (msg := found[p]) is not None]


def check_lengths(conversations: Sequence[Conversation], tokenizer, max_tokens: int, *, tokens_per_image: int = 0,
                  progress: bool = True) -> list[Problem]:
    """Turns and whole conversations longer than ``max_tokens`` tokens of ``tokenizer`` (a tokenizer or a processor).

    A turn counts its text (markers removed) plus ``tokens_per_image`` per marker; a conversation counts its chat
    template rendering (``to_messages``; the plain turns where the tokenizer has no template) plus
    ``tokens_per_image - 1`` per image beyond the placeholder the template writes (LLaVA-1.5: 576, the embedded
    target: 144; Qwen2.5-VL's count depends on the image size: give its largest).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    template = getattr(tokenizer, "chat_template", None) or getattr(tok, "chat_template", None)
    found = []
    for c in tqdm(conversations, desc="checking lengths", unit="record", leave=False, mininterval=2.0,
                  disable=not progress):
        ids = tok([t.text.replace(IMAGE_MARK, "") for t in c.turns], add_special_tokens=False)["input_ids"]
        for k, (t, row) in enumerate(zip(c.turns, ids)):
            n = len(row) + t.text.count(IMAGE_MARK) * tokens_per_image
            if n > max_tokens:
                found.append(_problem(c, f"turn {k} ({t.role}) is {n} tokens, over the limit of {max_tokens}",
                                      "shorten or split the turn, or raise the limit"))
        if template:
            text = tokenizer.apply_chat_template(to_messages(c), tokenize=False)
            total = len(tok(text, add_special_tokens=False)["input_ids"])
            total += len(c.images) * max(tokens_per_image - 1, 0)
        else:
            total = sum(len(r) for r in ids) + len(c.images) * tokens_per_image
        if total > max_tokens:
            found.append(_problem(c, f"the whole conversation is {total} tokens, over the limit of {max_tokens}",
                                  "split it into shorter conversations, or raise the limit"))
    return found


def validate(conversations: Sequence[Conversation], *, check_images: bool = True, tokenizer=None,
             max_tokens: int | None = None, tokens_per_image: int = 0, max_errors: int = MAX_SHOWN,
             progress: bool = True) -> None:
    """The checks a file alone cannot answer, all before training: every image opens (``check_images``), and no turn
    or conversation is over ``max_tokens`` (with a ``tokenizer``). Raises one DataError listing every problem."""
    out = _Problems()
    for p in _validate(conversations, check_images, tokenizer, max_tokens, tokens_per_image, progress):
        out.add(p)
    if (err := out.error(max_errors)) is not None:
        raise err


def _validate(conversations, images: bool, tokenizer, max_tokens, tokens_per_image, progress) -> list[Problem]:
    found = check_images(conversations, progress=progress) if images else []
    if tokenizer is not None and max_tokens is not None:
        found += check_lengths(conversations, tokenizer, max_tokens, tokens_per_image=tokens_per_image,
                               progress=progress)
    return sorted(found, key=lambda p: (p.file, p.index or 0))


def load_conversations(path: str | Path, image_root: str | Path | None = None, *, check_images: bool = True,
                       tokenizer=None, max_tokens: int | None = None, tokens_per_image: int = 0,
                       max_errors: int = MAX_SHOWN, progress: bool = True) -> list[Conversation]:
    """``read_conversations`` then ``validate`` on the records that parsed, with one DataError for both: what a
    trainer calls before its first step."""
    out = _Problems()
    convs = _read(path, image_root, True, progress, out)
    for p in _validate(convs, check_images, tokenizer, max_tokens, tokens_per_image, progress):
        out.add(p)
    if (err := out.error(max_errors)) is not None:
        raise err
    return convs
