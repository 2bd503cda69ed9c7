"""Multi-image sets (compare, count across, odd one out, story) and frame sequences (video-like motion)."""

from __future__ import annotations

import random

from specula.world.draw import Canvas
from specula.world.phrasing import article, join_list, pick, sentence, SHORT_SUFFIX
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


def make_multi(rng: random.Random, suite: str, task: str, k: int | None = None) -> Sample:
    k = k or rng.randint(2, 5)
    if task == "caption":
        qtype = "story"
    else:
        qtype = pick(rng, ("odd", "count", "which", "same") if k == 2 else ("odd", "count", "which"))
    if qtype == "odd" and k >= 3:
        base = (pick(rng, COLOUR_NAMES), pick(rng, SHAPES))
        odd_i = rng.randrange(k)
        while True:
            other = (pick(rng, COLOUR_NAMES), base[1]) if rng.random() < 0.5 else (base[0], pick(rng, SHAPES))
            if other != base:
                break
        scenes = [_single(rng, *(other if i == odd_i else base)) for i in range(k)]
        q = pick(rng, ("Which image is different from the others?", "Which image is the odd one out?"))
        a, n = ORDINALS[odd_i], k
        resp = a
    else:
        scenes = [sample_scene(rng, 1, 2, allow_overlap=False) for _ in range(k)]
        if qtype in ("count", "odd"):
            shape = pick(rng, [o.shape for s in scenes for o in s.objects]) if rng.random() < 0.8 else pick(rng, SHAPES)
            m = sum(any(o.shape == shape for o in s.objects) for s in scenes)
            q = pick(rng, ("How many images show a {s}?", "In how many images is there a {s}?")).format(s=shape)
            a, n = NUMBER_WORDS[m], k + 1
        elif qtype == "which":
            i = rng.randrange(k)
            scenes[i] = _single(rng, pick(rng, COLOUR_NAMES), pick(rng, SHAPES))
            q = pick(rng, ("What colour is the object in the {o} image?", "In the {o} image, what colour is the object?")).format(o=ORDINALS[i])
            a, n = scenes[i].objects[0].colour, len(COLOUR_NAMES)
        elif qtype == "same":
            scenes = [_single(rng, pick(rng, COLOUR_NAMES), pick(rng, SHAPES)) for _ in range(2)]
            if rng.random() < 0.5:
                o = scenes[0].objects[0]
                scenes[1] = _single(rng, pick(rng, COLOUR_NAMES), o.shape)
            same = scenes[0].objects[0].shape == scenes[1].objects[0].shape
            q = pick(rng, ("Do both images show the same shape?", "Is the shape in the two images the same?"))
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
            lines.append(sentence(pick(rng, ("in the {o} image there is {t}.", "the {o} image shows {t}.", "image {n} has {t}."))
                                  .format(o=ORDINALS[i], t=things, n=i + 1)))
        attrs = tuple(w for s in scenes for o in s.objects for w in (o.colour, o.shape))
        return Sample(suite, "multi_caption", images, _prompt(rng, k, q if a is None else "Describe the images in order."),
                      " ".join(lines), None, None, attrs, pw)
    return Sample(suite, f"multi/{qtype}", images, _prompt(rng, k, f"{q} {pick(rng, SHORT_SUFFIX)}"), a, a, n, (), pw)


DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def make_video(rng: random.Random, suite: str, task: str) -> Sample:
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
    marks = "<image>" * k
    if task == "caption":
        change = f", turning from {c0} to {c1} on the way" if c1 != c0 else ""
        text = sentence(pick(rng, (
            "{a} {c} {s} moves {d} across the frames{ch}.",
            "over the {k} frames {a} {c} {s} travels {d}{ch}.",
            "the video shows {a} {c} {s} moving {d}{ch}.",
        )).format(a=article(c0), c=c0, s=shape, d=direction, k=NUMBER_WORDS[k], ch=change))
        return Sample(suite, "video_caption", tuple(images), marks + pick(rng, ("Describe the video.", "What happens in these frames?")),
                      text, None, None, (c0, shape, direction), tuple(pws))
    qtype = pick(rng, ("direction", "direction", "change", "end_colour"))
    if qtype == "direction":
        q = pick(rng, ("Which way does the {s} move?", "In which direction is the {s} moving?")).format(s=shape)
        a, n = direction, 4
    elif qtype == "change":
        q, a, n = pick(rng, ("Does the object change colour?", "Does the colour of the object change?")), ("yes" if c1 != c0 else "no"), 2
    else:
        q, a, n = pick(rng, ("What colour is the object in the last frame?", "What colour is the object at the end?")), c1, len(COLOUR_NAMES)
    return Sample(suite, f"video/{qtype}", tuple(images), f"{marks}{q} {pick(rng, SHORT_SUFFIX)}", a, a, n, (), tuple(pws))
