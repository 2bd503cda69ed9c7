"""Small helpers that give the world's language its entropy: paraphrase choice, lists, articles."""

from __future__ import annotations

import random
from typing import Sequence


def pick(rng: random.Random, options: Sequence[str]) -> str:
    return options[rng.randrange(len(options))]


def maybe(rng: random.Random, p: float, text: str) -> str:
    return text if rng.random() < p else ""


def article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def join_list(rng: random.Random, items: Sequence[str]) -> str:
    """'a, b and c' (sometimes with an Oxford comma)."""
    items = list(items)
    if len(items) == 1:
        return items[0]
    comma = "," if len(items) > 2 and rng.random() < 0.5 else ""
    return ", ".join(items[:-1]) + f"{comma} and " + items[-1]


def sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:]


def clean(text: str) -> str:
    """Collapse the double spaces left by optional clauses."""
    return " ".join(text.split()).replace(" .", ".").replace(" ,", ",")


SHORT_SUFFIX = (
    "Answer with one word.",
    "Answer briefly.",
    "Answer with a single word or phrase.",
    "Give a short answer.",
)


def maybe_suffix(rng: random.Random, question: str) -> str:
    """A dialogue follow-up: half the time with an answer-format suffix, as in the evaluation prompts."""
    return f"{question} {pick(rng, SHORT_SUFFIX)}" if rng.random() < 0.5 else question
