"""Prompts that do not open with their image: a line of text before it, the question before it, a system turn.

Every prompt the suites make starts with its image (``<image>What colour ...``), and a target trained only on those
reads an image only there: with one sentence or a system turn in front, the cycle-2 target answered VQA at its
blank-image level (zoo/TRAINING.md, "Image sets: the LM reads the first image of a set"). Users of the OpenAI API
write text parts before image parts and send system messages, so a mix for the next target places part of its
one-image prompts in those forms (``placed``), and ``zoo eval`` asks the same VQA questions in them (``variant``),
with lines and system messages held out of training.

A lead line is built from up to three short parts (a greeting, some context, an ask) so that the LM sees many
lengths and wordings rather than a few memorised lines.
"""

from __future__ import annotations

import dataclasses
import random

from specula.world.sample import IMAGE_MARK, Sample

GREETINGS = ("Hi! ", "Hello. ", "Hey there. ", "Good morning. ", "Hi, quick question. ", "Hello again. ")
CONTEXTS = ("I took this photo yesterday. ", "My friend drew this for me. ", "This is from our collection. ",
            "I found this picture in an old book. ", "We made this drawing in class today. ",
            "Here is a picture. ", "This came with the homework. ", "My little brother made this. ",
            "I am not sure what I am looking at. ", "This one is from the second page. ")
ASKS = ("Please look at it. ", "Can you help me with it? ", "Tell me something about it. ",
        "Take a careful look at the following picture. ", "See below. ", "Image: ", "Question about this: ",
        "Have a look. ", "Here it is: ", "What do you make of this? ")
SYSTEMS = ("You are a careful assistant.", "You answer questions about pictures.",
           "You are a friendly helper. Keep answers short.", "Answer the user's question.",
           "You are an assistant that describes images accurately.", "Be brief and precise.",
           "You are a vision assistant.", "Reply in plain English.")

# held out of training: what ``zoo eval`` puts in front of its VQA questions
EVAL_LEAD = "Here is a drawing my colleague sent me this morning, and I have a question about it. "
EVAL_SYSTEM = "You are a helpful assistant."

VARIANTS = ("lead", "question_first", "system")  # the forms ``variant`` writes (image first is the suites' own)


def lead_line(rng: random.Random) -> str:
    """One to three parts, in the order greeting, context, ask."""
    pools = [pool for p, pool in ((0.4, GREETINGS), (0.6, CONTEXTS), (0.6, ASKS)) if rng.random() < p]
    if not pools:
        pools = [rng.choice((CONTEXTS, ASKS))]
    return "".join(rng.choice(pool) for pool in pools)


def question_first(prompt: str) -> str | None:
    """``<image>Question`` -> ``Question <image>`` (the tokenizer has no newline); None for other prompts."""
    if not prompt.startswith(IMAGE_MARK) or prompt.count(IMAGE_MARK) != 1:
        return None
    return prompt[len(IMAGE_MARK):].strip() + " " + IMAGE_MARK


def variant(s: Sample, form: str, lead: str = EVAL_LEAD, system: str = EVAL_SYSTEM) -> Sample:
    """``s`` asked in one of ``VARIANTS``' forms (a one-image sample whose prompt opens with its image)."""
    if form == "lead":
        return dataclasses.replace(s, prompt=lead + s.prompt)
    if form == "question_first":
        moved = question_first(s.prompt)
        if moved is None:
            raise ValueError(f"{s.suite}/{s.kind}: the prompt does not open with its only image")
        return dataclasses.replace(s, prompt=moved)
    if form == "system":
        return dataclasses.replace(s, system=system)
    raise ValueError(f"unknown prompt form {form!r}; choose from {', '.join(VARIANTS)}")


def place(rng: random.Random, s: Sample, share: float = 0.5) -> Sample:
    """With probability ``share``, ``s`` with its image moved off the start of the prompt: a lead line (40%), the
    question first (30%) or a system turn (30%, half of those also with a lead line). Image sets and text-only
    samples get only the system turn. Draws from ``rng`` after the sample's own draws, so it stays deterministic."""
    if rng.random() >= share:
        return s
    one_image = len(s.images) == 1 and s.prompt.startswith(IMAGE_MARK)
    r = rng.random()
    if one_image and r < 0.4:
        return dataclasses.replace(s, prompt=lead_line(rng) + s.prompt)
    if one_image and r < 0.7:
        return dataclasses.replace(s, prompt=question_first(s.prompt))
    prompt = lead_line(rng) + s.prompt if one_image and rng.random() < 0.5 else s.prompt
    return dataclasses.replace(s, prompt=prompt, system=rng.choice(SYSTEMS))


def placed(maker, share: float = 0.5):
    """A mix entry's maker whose samples go through ``place``."""
    def make(rng: random.Random, suite: str, task: str) -> Sample:
        return place(rng, maker(rng, suite, task), share)
    make.__name__ = f"placed_{getattr(maker, '__name__', 'maker')}"
    return make
