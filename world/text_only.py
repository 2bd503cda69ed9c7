"""Text-only conversations: arithmetic, definitions, small stories, and scenes described in words.

The described-scene questions teach the language model to find an object by one attribute and copy another
from its context, which is the same skill it needs to answer from visual tokens."""

from __future__ import annotations

import random

from specula.world.phrasing import article, clean, join_list, pick, sentence, SHORT_SUFFIX
from specula.world.sample import Sample
from specula.world.scene import dialogue_turns, sample_scene, vqa
from specula.world.vocab import COLOUR_NAMES, NUMBER_WORDS, SHAPES

DEFINITIONS = {
    "circle": ("a round shape with no corners", "a curve whose points all lie at the same distance from its center"),
    "square": ("a shape with four equal sides and four right angles", "a rectangle whose sides all have the same length"),
    "triangle": ("a shape with three straight sides and three corners", "a polygon with three sides"),
    "star": ("a shape with pointed tips around a center", "a figure with five points spreading out from the middle"),
    "diamond": ("a square turned on its corner", "a shape with four equal sides standing on one point"),
    "cross": ("two bars that meet at right angles", "a shape made of one vertical and one horizontal bar"),
    "bar chart": ("a chart that shows values as bars of different heights", "a picture of numbers drawn as bars"),
    "pie chart": ("a circle cut into slices whose sizes show shares", "a chart where each slice is part of a whole"),
}
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")


def make(rng: random.Random, suite: str, task: str) -> Sample:
    kind = pick(rng, ("arith", "define", "story", "scene", "scene", "scene"))
    if kind == "arith":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op = pick(rng, ("plus", "minus", "times"))
        if op == "minus" and b > a:
            a, b = b, a
        r = a + b if op == "plus" else a - b if op == "minus" else a * b
        q = pick(rng, ("What is {a} {o} {b}?", "Compute {a} {o} {b}.", "How much is {a} {o} {b}?")).format(a=a, o=op, b=b)
        resp = pick(rng, ("{a} {o} {b} is {r}.", "The answer is {r}.", "{a} {o} {b} equals {r}.")).format(a=a, o=op, b=b, r=r)
        return Sample(suite, "text/arith", (), q, resp, str(r), None)
    if kind == "define":
        w = pick(rng, sorted(DEFINITIONS))
        q = pick(rng, ("What is {a} {w}?", "Define {a} {w}.", "Explain what {a} {w} is.")).format(a=article(w), w=w)
        resp = sentence(f"{article(w)} {w} is {pick(rng, DEFINITIONS[w])}.")
        return Sample(suite, "text/define", (), q, resp, None, None)
    if kind == "story":
        name, colour, shape = pick(rng, NAMES), pick(rng, COLOUR_NAMES), pick(rng, SHAPES)
        n = rng.randint(2, 5)
        q = pick(rng, ("Tell me a short story about a {c} {s}.", "Write a tiny story about {n} and a {c} {s}.")).format(c=colour, s=shape, n=name)
        resp = clean(" ".join([
            sentence(pick(rng, ("once {n} found a {c} {s}.", "one morning {n} drew a {c} {s}.", "{n} had a {c} {s}."))
                     .format(n=name, c=colour, s=shape)),
            sentence(pick(rng, ("{n} made {k} more of them.", "soon there were {k} of them on the table.", "then {n} counted {k} of them."))
                     .format(n=name, k=NUMBER_WORDS[n])),
            sentence(pick(rng, ("in the end {n} was happy.", "it was a good day.", "{n} smiled and went home."))
                     .format(n=name)),
        ]))
        return Sample(suite, "text/story", (), q, resp, None, None)
    scene = sample_scene(rng, 1, 4, allow_overlap=False)
    listed = join_list(rng, [f"{article(o.size)} {o.size} {o.colour} {o.shape} in the {o.where}" for o in scene.objects])
    ctx = sentence(pick(rng, ("there is {l}.", "a picture shows {l}.", "imagine {l}.")).format(l=listed))
    q, a, k = vqa(rng, scene)
    return Sample(suite, "text/scene", (), f"{ctx} {q} {pick(rng, SHORT_SUFFIX)}", a, a, k)


def make_scene_dialogue(rng: random.Random, suite: str, task: str, n_turns: int = 12) -> Sample:
    """A scene described in words, then up to ``n_turns`` distinct short questions about it as successive turns.

    The cheap form of the grounding skill (find an object by one attribute, copy another from the context): no
    image, ~60 tokens of context, and every turn's answer is supervised."""
    scene = sample_scene(rng, 1, 5, allow_overlap=False)
    listed = join_list(rng, [f"{article(o.size)} {o.size} {o.colour} {o.shape} in the {o.where}" for o in scene.objects])
    ctx = sentence(pick(rng, ("there is {l}.", "a picture shows {l}.", "imagine {l}.")).format(l=listed))
    (q0, a0), *rest = dialogue_turns(rng, scene, n_turns)
    return Sample(suite, "text/scene_dialogue", (), f"{ctx} {q0}", a0, a0, None, (), (), tuple(rest))
