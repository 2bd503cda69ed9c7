"""Charts: bar, line and pie charts with labelled values, and questions that need reading them."""

from __future__ import annotations

import random

from specula.world.draw import Canvas
from specula.world.phrasing import join_list, pick, sentence, SHORT_SUFFIX
from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.vocab import COLOURS, NUMBER_WORDS, ORDINALS

CHART_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
BG = (236, 236, 232)


def _bar(rng: random.Random):
    k = rng.randint(3, 5)
    colours = rng.sample(CHART_COLOURS, k)
    values = [rng.randint(1, 9) for _ in range(k)]
    c = Canvas.new(BG, rng, noise=3.0)
    base, top = IMAGE_SIZE - 14, 26
    unit = (base - top) / 9
    for v in range(0, 10, 3):  # light grid lines
        y = base - v * unit
        c.line([(8, y), (IMAGE_SIZE - 6, y)], (200, 200, 200), width=1)
    width = (IMAGE_SIZE - 20) / k
    for i, (col, v) in enumerate(zip(colours, values)):
        x0 = 12 + i * width + width * 0.15
        x1 = 12 + (i + 1) * width - width * 0.15
        y = base - v * unit
        c.rect((x0, y, x1, base), COLOURS[col], (col, "bar"))
        c.text(((x0 + x1) / 2, y - 9), str(v), 16, (20, 20, 20), (str(v),))
    c.line([(8, base), (IMAGE_SIZE - 6, base)], (40, 40, 40), width=2)
    return c, colours, values


def _line(rng: random.Random):
    k = 5
    values = [rng.randint(1, 9) for _ in range(k)]
    while len(set(values)) < 3 or values.count(max(values)) > 1:
        values = [rng.randint(1, 9) for _ in range(k)]
    col = pick(rng, CHART_COLOURS)
    c = Canvas.new(BG, rng, noise=3.0)
    base, top = IMAGE_SIZE - 14, 22
    unit = (base - top) / 9
    xs = [18 + i * (IMAGE_SIZE - 36) / (k - 1) for i in range(k)]
    pts = [(x, base - v * unit) for x, v in zip(xs, values)]
    c.line([(8, base), (IMAGE_SIZE - 6, base)], (40, 40, 40), width=2)
    c.line(pts, COLOURS[col], width=4)
    for (x, y), v in zip(pts, values):
        c.shape("circle", x, y, 5, COLOURS[col], (col, "point"))
        c.text((x, max(10, y - 12)), str(v), 14, (20, 20, 20), (str(v),))
    return c, col, values


def _pie(rng: random.Random):
    k = rng.randint(2, 4)
    colours = rng.sample(CHART_COLOURS, k)
    while True:
        shares = [rng.randint(1, 9) for _ in range(k)]
        if shares.count(max(shares)) == 1:
            break
    c = Canvas.new(BG, rng, noise=3.0)
    total, angle = sum(shares), -90.0
    for col, s in zip(colours, shares):
        span = 360.0 * s / total
        c.pie((14, 14, IMAGE_SIZE - 14, IMAGE_SIZE - 14), angle, angle + span, COLOURS[col], (col, "slice"))
        angle += span
    return c, colours, shares


def make(rng: random.Random, suite: str, task: str) -> Sample:
    kind = pick(rng, ("bar", "bar", "line", "pie"))
    if kind == "bar":
        c, colours, values = _bar(rng)
        k = len(colours)
        best = colours[values.index(max(values))] if values.count(max(values)) == 1 else None
        qtype = pick(rng, ("value", "value", "count", "compare", "tallest"))
        if qtype == "tallest" and best is None:
            qtype = "value"
        if qtype == "value":
            i = rng.randrange(k)
            q = pick(rng, ("What is the value of the {c} bar?", "What value does the {c} bar show?", "How high is the {c} bar?")).format(c=colours[i])
            a, n = str(values[i]), 9
        elif qtype == "count":
            q, a, n = pick(rng, ("How many bars are there?", "How many bars does the chart have?")), NUMBER_WORDS[k], 3
        elif qtype == "compare":
            i, j = rng.sample(range(k), 2)
            q = f"Is the {colours[i]} bar taller than the {colours[j]} bar?"
            a, n = ("yes" if values[i] > values[j] else "no"), 2
        else:
            q, a, n = pick(rng, ("Which bar is the tallest?", "Which colour is the tallest bar?")), best, len(CHART_COLOURS)
        desc = sentence(f"a bar chart with {NUMBER_WORDS[k]} bars: " + join_list(
            rng, [f"{col} at {v}" for col, v in zip(colours, values)]) + ".")
    elif kind == "line":
        c, col, values = _line(rng)
        qtype = pick(rng, ("trend", "highest", "value"))
        if qtype == "trend" and values[-1] != values[0]:
            q = pick(rng, ("Does the line end higher or lower than it starts?", "Is the last point higher or lower than the first?"))
            a, n = ("higher" if values[-1] > values[0] else "lower"), 2
        elif qtype == "value":
            i = rng.randrange(5)
            q = f"What is the value of the {ORDINALS[i]} point?"
            a, n = str(values[i]), 9
        else:
            q = pick(rng, ("Which point of the line is the highest?", "At which point does the line peak?"))
            a, n = ORDINALS[values.index(max(values))], 5
        desc = sentence(f"a {col} line chart with five points: " + ", ".join(str(v) for v in values) + ".")
        colours = [col]
    else:
        c, colours, shares = _pie(rng)
        best = colours[shares.index(max(shares))]
        if rng.random() < 0.6:
            q, a, n = pick(rng, ("Which colour has the largest slice?", "Which slice of the pie is biggest?")), best, len(CHART_COLOURS)
        else:
            q, a, n = pick(rng, ("How many slices does the pie have?", "How many slices are there?")), NUMBER_WORDS[len(colours)], 3
        desc = sentence(f"a pie chart with {NUMBER_WORDS[len(colours)]} slices; the {best} slice is the largest.")
    pw = (c.patch_words(),)
    if task == "caption":
        return Sample(suite, f"chart_caption/{kind}", (c.image,), "<image>" + pick(rng, ("Describe the chart.", "What does this chart show?")),
                      desc, None, None, tuple(colours), pw)
    prompt = f"<image>{q} {pick(rng, SHORT_SUFFIX)}"
    return Sample(suite, f"chart/{kind}", (c.image,), prompt, a, a, n, (), pw)
