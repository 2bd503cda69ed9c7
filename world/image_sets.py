"""Multi-image sets (compare, count across, odd one out, story) and frame sequences (video-like motion)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from specula.world.draw import Canvas
from specula.world.phrasing import article, join_list, maybe_suffix, pick, sentence, SHORT_SUFFIX
from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.scene import Obj, Scene, render_scene, sample_scene
from specula.world.vocab import BACKGROUNDS, COLOURS, COLOUR_NAMES, NUMBER_WORDS, ORDINALS, SHAPES, SIZES


def _single(rng: random.Random, colour: str, shape: str) -> Scene:
    s = sample_scene(rng, 1, 1, allow_overlap=False)
    o = s.objects[0]
    return Scene((Obj(shape, colour, o.size, o.cell, o.cx, o.cy),), s.background)


def _prompt(rng: random.Random, k: int, q: str) -> str:
    if rng.random() < 0.5:
        marks = " ".join(f"Image {i + 1}: <image>" for i in range(k))
    else:
        marks = "<image>" * k
    return f"{marks} {q}"


# Question phrasings, shared by the single-question samples and the training dialogues.
MULTI_ODD = ("Which image is different from the others?", "Which image is the odd one out?")
MULTI_COUNT = ("How many images show a {s}?", "In how many images is there a {s}?")
MULTI_WHICH = ("What colour is the object in the {o} image?", "In the {o} image, what colour is the object?")
MULTI_SAME = ("Do both images show the same shape?", "Is the shape in the two images the same?")


def _odd_scenes(rng: random.Random, k: int) -> tuple[list[Scene], int]:
    """``k`` one-object images alike in colour and shape but one, which differs in one of the two; and its index."""
    base = (pick(rng, COLOUR_NAMES), pick(rng, SHAPES))
    odd_i = rng.randrange(k)
    while True:
        other = (pick(rng, COLOUR_NAMES), base[1]) if rng.random() < 0.5 else (base[0], pick(rng, SHAPES))
        if other != base:
            break
    return [_single(rng, *(other if i == odd_i else base)) for i in range(k)], odd_i


def make_multi(rng: random.Random, suite: str, task: str, k: int | None = None, scan: bool = False) -> Sample:
    """One question about 2-5 images (odd one out, count across, the colour in the n-th image, same shape), or with
    ``task="caption"`` a description of each image in order; ``scan`` words every image's line the same way
    ("Image 2 has ...", a fixed reading order the LM writes out, as scene captions' cell scans do)."""
    k = k or rng.randint(2, 5)
    if task == "caption":
        qtype = "story"
    else:
        qtype = pick(rng, ("odd", "count", "which", "same") if k == 2 else ("odd", "count", "which"))
        # a pair has no odd one out: its question counts, and is labelled so (not "multi/odd", which would put
        # counting questions into the odd-one-out row of the evaluation's breakdown by question type)
        if qtype == "odd" and k < 3:
            qtype = "count"
    if qtype == "odd":
        scenes, odd_i = _odd_scenes(rng, k)
        q = pick(rng, MULTI_ODD)
        a, n = ORDINALS[odd_i], k
        resp = a
    else:
        scenes = [sample_scene(rng, 1, 2, allow_overlap=False) for _ in range(k)]
        if qtype == "count":
            shape = pick(rng, [o.shape for s in scenes for o in s.objects]) if rng.random() < 0.8 else pick(rng, SHAPES)
            m = sum(any(o.shape == shape for o in s.objects) for s in scenes)
            q = pick(rng, MULTI_COUNT).format(s=shape)
            a, n = NUMBER_WORDS[m], k + 1
        elif qtype == "which":
            i = rng.randrange(k)
            scenes[i] = _single(rng, pick(rng, COLOUR_NAMES), pick(rng, SHAPES))
            q = pick(rng, MULTI_WHICH).format(o=ORDINALS[i])
            a, n = scenes[i].objects[0].colour, len(COLOUR_NAMES)
        elif qtype == "same":
            scenes = [_single(rng, pick(rng, COLOUR_NAMES), pick(rng, SHAPES)) for _ in range(2)]
            if rng.random() < 0.5:
                o = scenes[0].objects[0]
                scenes[1] = _single(rng, pick(rng, COLOUR_NAMES), o.shape)
            same = scenes[0].objects[0].shape == scenes[1].objects[0].shape
            q = pick(rng, MULTI_SAME)
            a, n = ("yes" if same else "no"), 2
        else:  # story: describe each image in order
            q, a, n = pick(rng, ("Describe the images in order.", "Tell what happens across these images.")), None, None
    rendered = [render_scene(s, rng) for s in scenes]
    images = tuple(r[0] for r in rendered)
    pw = tuple(r[1] for r in rendered)
    if a is None or task == "caption":
        lines = []
        for i, s in enumerate(scenes):
            things = join_list(rng, [f"{article(o.colour)} {o.colour} {o.shape}" for o in s.objects])
            form = "image {n} has {t}." if scan else pick(rng, ("in the {o} image there is {t}.", "the {o} image shows {t}.",
                                                                   "image {n} has {t}."))
            lines.append(sentence(form.format(o=ORDINALS[i], t=things, n=i + 1)))
        attrs = tuple(w for s in scenes for o in s.objects for w in (o.colour, o.shape))
        return Sample(suite, "multi_caption", images, _prompt(rng, k, q if a is None else "Describe the images in order."),
                      " ".join(lines), None, None, attrs, pw)
    return Sample(suite, f"multi/{qtype}", images, _prompt(rng, k, f"{q} {pick(rng, SHORT_SUFFIX)}"), a, a, n, (), pw)


def make_multi_dialogue(rng: random.Random, suite: str, task: str, n_turns: int = 8, k: int | None = None,
                        odd: bool = False) -> Sample:
    """A training dialogue: ``k`` images (default 2-5), then up to ``n_turns`` distinct questions about them as
    successive turns (the first in the evaluation format): the colour in each one-object image, how many images show
    each shape present (and sometimes one absent), the odd one out when the set has one, same shape for a pair.
    ``odd``: always a set of 3-5 with an odd one out (otherwise two in five sets of 3 or more)."""
    k = k or rng.randint(3 if odd else 2, 5)
    odd_i = None
    if k >= 3 and (odd or rng.random() < 0.4):
        scenes, odd_i = _odd_scenes(rng, k)
    else:
        scenes = [_single(rng, pick(rng, COLOUR_NAMES), pick(rng, SHAPES)) if rng.random() < 0.6
                  else sample_scene(rng, 1, 2, allow_overlap=False) for _ in range(k)]
    return _set_dialogue(rng, suite, scenes, n_turns, odd_i=odd_i, odd=odd)


def _set_dialogue(rng: random.Random, suite: str, scenes: list[Scene], n_turns: int, odd_i: int | None = None,
                  odd: bool = False, ask: str | None = None) -> Sample:
    """The turns of ``make_multi_dialogue`` about ``scenes`` (``odd_i``: the odd image's index, if any; ``odd``: keep
    its turn among the first ``n_turns``); ``ask``: a shape whose count is always asked, first."""
    k = len(scenes)
    singles = [i for i, sc in enumerate(scenes) if len(sc.objects) == 1]
    shown = sorted({o.shape for sc in scenes for o in sc.objects})
    turns = [(pick(rng, MULTI_WHICH).format(o=ORDINALS[i]), scenes[i].objects[0].colour) for i in singles]
    if ask is None:
        absent = [sh for sh in SHAPES if sh not in shown]  # empty when the set shows all six shapes
        counted = shown + ([pick(rng, absent)] if absent and rng.random() < 0.5 else [])
    else:
        counted = sorted(set(shown) | {ask})
    count_turns = [(pick(rng, MULTI_COUNT).format(s=sh),
                    NUMBER_WORDS[sum(any(o.shape == sh for o in sc.objects) for sc in scenes)]) for sh in counted]
    turns += count_turns
    if odd_i is not None:
        turns.append((pick(rng, MULTI_ODD), ORDINALS[odd_i]))
    if k == 2 and len(singles) == 2:
        same = scenes[0].objects[0].shape == scenes[1].objects[0].shape
        turns.append((pick(rng, MULTI_SAME), "yes" if same else "no"))
    rng.shuffle(turns)
    if odd:  # keep the odd turn among the first n_turns (a set of five has up to nine turns)
        i = next(j for j, (q, _) in enumerate(turns) if q in MULTI_ODD)
        if i >= n_turns:
            j = rng.randrange(n_turns)
            turns[i], turns[j] = turns[j], turns[i]
    if ask is not None:  # the asked count leads, in the evaluation format
        i = turns.index(count_turns[counted.index(ask)])
        turns[0], turns[i] = turns[i], turns[0]
    (q0, a0), rest = turns[0], turns[1:n_turns]
    rendered = [render_scene(sc, rng) for sc in scenes]
    followups = tuple((maybe_suffix(rng, q), a) for q, a in rest)
    return Sample(suite, "multi_dialogue", tuple(r[0] for r in rendered), _prompt(rng, k, f"{q0} {pick(rng, SHORT_SUFFIX)}"),
                  a0, a0, None, (), tuple(r[1] for r in rendered), followups)


def make_count_dialogue(rng: random.Random, suite: str, task: str, n_turns: int = 8) -> Sample:
    """``make_multi_dialogue`` about a set of 2-5 built for counting: a shape shown in m of its images, m drawn
    evenly from 0 to the set's size (in the suite's sets most counts are "one", which a model answers blind), the
    other images showing one or two other shapes; an image may show the shape twice (it still counts once). Its
    first turn asks how many images show that shape."""
    k = rng.randint(2, 5)
    shape = pick(rng, SHAPES)
    others = tuple(rng.sample([sh for sh in SHAPES if sh != shape], rng.randint(1, 2)))
    hits = set(rng.sample(range(k), rng.randint(0, k)))
    scenes = []
    for i in range(k):
        palette = (shape,) if i in hits else others
        if rng.random() < 0.7:
            scenes.append(_single(rng, pick(rng, COLOUR_NAMES), pick(rng, palette)))
        else:  # two objects of the palette (distinct colours when it is one shape)
            scenes.append(sample_scene(rng, 2, 2, allow_overlap=False, shapes=palette))
    return _set_dialogue(rng, suite, scenes, n_turns, ask=shape)


def make_odd_dialogue(rng: random.Random, suite: str, task: str) -> Sample:
    """``make_multi_dialogue`` about a set of 3-5 with an odd one out (the odd turn is among its turns)."""
    return make_multi_dialogue(rng, suite, task, odd=True)


DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


@dataclass(frozen=True)
class Clip:
    """An object moving across ``len(images)`` frames in ``direction``, colour ``c0`` turning ``c1`` half way."""

    direction: str
    shape: str
    c0: str
    c1: str
    images: tuple[Image.Image, ...]
    patch_words: tuple[tuple[tuple[str, ...], ...], ...]


def make_clip(rng: random.Random) -> Clip:
    """An object moving across 4 to 8 frames, sometimes changing colour half way."""
    k = rng.randint(4, 8) if rng.random() < 0.3 else 4
    direction = pick(rng, sorted(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    shape, c0 = pick(rng, SHAPES), pick(rng, COLOUR_NAMES)
    c1 = pick(rng, [c for c in COLOUR_NAMES if c != c0]) if rng.random() < 0.4 else c0
    size = pick(rng, sorted(SIZES))
    bg = pick(rng, sorted(BACKGROUNDS))
    margin = 34
    span = IMAGE_SIZE - 2 * margin
    cross = rng.uniform(margin, IMAGE_SIZE - margin)
    images, pws = [], []
    for t in range(k):
        frac = t / (k - 1)
        along = margin + (frac if (dx + dy) > 0 else 1 - frac) * span
        cx, cy = (along, cross) if dx else (cross, along)
        col = c0 if t < k // 2 else c1
        canvas = Canvas.new(BACKGROUNDS[bg], rng)
        canvas.shape(shape, cx, cy, SIZES[size] / 2, COLOURS[col], (col, shape))
        images.append(canvas.image)
        pws.append(canvas.patch_words())
    return Clip(direction, shape, c0, c1, tuple(images), tuple(pws))


VIDEO_DIRECTION = ("Which way does the {s} move?", "In which direction is the {s} moving?")
VIDEO_CHANGE = ("Does the object change colour?", "Does the colour of the object change?")
VIDEO_END = ("What colour is the object in the last frame?", "What colour is the object at the end?")
VIDEO_START = ("What colour is the object in the first frame?", "What colour is the object at the start?")
VIDEO_SHAPE = ("What shape moves across the frames?", "Which shape is moving?")


def video_question(rng: random.Random, qtype: str, clip: Clip) -> tuple[str, str, int]:
    """(question, answer, n_choices) about a clip: "direction", "change", "end_colour" (the suite's types) or the
    training-only "start_colour" and "shape"."""
    if qtype == "direction":
        return pick(rng, VIDEO_DIRECTION).format(s=clip.shape), clip.direction, 4
    if qtype == "change":
        return pick(rng, VIDEO_CHANGE), ("yes" if clip.c1 != clip.c0 else "no"), 2
    if qtype == "end_colour":
        return pick(rng, VIDEO_END), clip.c1, len(COLOUR_NAMES)
    if qtype == "start_colour":
        return pick(rng, VIDEO_START), clip.c0, len(COLOUR_NAMES)
    return pick(rng, VIDEO_SHAPE), clip.shape, len(SHAPES)


def make_video(rng: random.Random, suite: str, task: str) -> Sample:
    """An object moving across 4 to 8 frames, sometimes changing colour half way."""
    clip = make_clip(rng)
    k, shape, c0, c1, direction = len(clip.images), clip.shape, clip.c0, clip.c1, clip.direction
    marks = "<image>" * k
    if task == "caption":
        change = f", turning from {c0} to {c1} on the way" if c1 != c0 else ""
        text = sentence(pick(rng, (
            "{a} {c} {s} moves {d} across the frames{ch}.",
            "over the {k} frames {a} {c} {s} travels {d}{ch}.",
            "the video shows {a} {c} {s} moving {d}{ch}.",
        )).format(a=article(c0), c=c0, s=shape, d=direction, k=NUMBER_WORDS[k], ch=change))
        return Sample(suite, "video_caption", clip.images, marks + pick(rng, ("Describe the video.", "What happens in these frames?")),
                      text, None, None, (c0, shape, direction), clip.patch_words)
    qtype = pick(rng, ("direction", "direction", "change", "end_colour"))
    q, a, n = video_question(rng, qtype, clip)
    return Sample(suite, f"video/{qtype}", clip.images, f"{marks}{q} {pick(rng, SHORT_SUFFIX)}", a, a, n, (), clip.patch_words)


def make_video_dialogue(rng: random.Random, suite: str, task: str) -> Sample:
    """A training dialogue: one clip, then every question type about it as successive turns (the first in the
    evaluation format), so the frames' visual tokens train five readings."""
    clip = make_clip(rng)
    qtypes = ["direction", "change", "end_colour", "start_colour", "shape"]
    rng.shuffle(qtypes)
    turns = [video_question(rng, t, clip)[:2] for t in qtypes]
    (q0, a0), rest = turns[0], turns[1:]
    followups = tuple((maybe_suffix(rng, q), a) for q, a in rest)
    return Sample(suite, "video_dialogue", clip.images, f"{'<image>' * len(clip.images)}{q0} {pick(rng, SHORT_SUFFIX)}",
                  a0, a0, None, (), clip.patch_words, followups)
