"""Rendered text (OCR-like): signs carrying a word or a number, and questions that need reading them."""

from __future__ import annotations

import random

from specula.world.draw import Canvas
from specula.world.phrasing import article, pick, sentence, SHORT_SUFFIX
from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.vocab import BACKGROUNDS, COLOURS, SIGN_WORDS

SIGN_COLOURS = ("red", "green", "blue", "purple", "orange", "black")


def make(rng: random.Random, suite: str, task: str) -> Sample:
    bg = pick(rng, sorted(BACKGROUNDS))
    c = Canvas.new(BACKGROUNDS[bg], rng)
    colour = pick(rng, SIGN_COLOURS)
    is_number = rng.random() < 0.35
    text = str(rng.randint(10, 99)) if is_number else pick(rng, SIGN_WORDS)
    w = rng.randint(120, 150)
    h = rng.randint(56, 72)
    x0 = rng.randint(6, IMAGE_SIZE - w - 6)
    y0 = rng.randint(6, IMAGE_SIZE - h - 6)
    c.rect((x0, y0, x0 + w, y0 + h), COLOURS[colour], (colour, "sign"))
    ink = "white" if colour in ("red", "green", "blue", "purple", "black") else "black"
    size = 34 if len(text) <= 4 else 28
    c.text((x0 + w / 2, y0 + h / 2), text.upper(), size, COLOURS[ink], (text,))
    pw = (c.patch_words(),)
    thing = "number" if is_number else "word"
    if task == "caption":
        desc = sentence(pick(rng, (
            "{a} {c} sign with the {t} {x} written on it in {i} letters.",
            "a {c} sign reading {x}, on a {b} background.",
            "the picture shows {a} {c} sign that says {x}.",
        )).format(a=article(colour), c=colour, t=thing, x=text.upper(), i=ink, b=bg))
        return Sample(suite, "ocr_caption", (c.image,), "<image>" + pick(rng, ("Describe the image.", "What is in this picture?")),
                      desc, None, None, (colour, text), pw)
    if rng.random() < 0.75:
        q = pick(rng, ("What does the sign say?", "What is written on the sign?", "Read the text on the sign.",
                       f"What {thing} is on the sign?"))
        a, n = text, (90 if is_number else len(SIGN_WORDS))
    else:
        q, a, n = pick(rng, ("What colour is the sign?", "Which colour is the sign?")), colour, len(SIGN_COLOURS)
    return Sample(suite, "ocr", (c.image,), f"<image>{q} {pick(rng, SHORT_SUFFIX)}", a, a, n, (), pw)
