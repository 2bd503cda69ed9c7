"""Charts: bar, line and pie charts with labelled values, and questions that need reading them."""

from __future__ import annotations

import random

from specula.world.draw import Canvas
from specula.world.phrasing import join_list, maybe_suffix, pick, sentence, SHORT_SUFFIX
from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.vocab import COLOURS, NUMBER_WORDS, ORDINALS

CHART_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
BG = (236, 236, 232)
LINE_XS = tuple(18 + i * (IMAGE_SIZE - 36) / 4 for i in range(5))  # a line chart's five points, left to right (px)
LINE_BASE, LINE_TOP = IMAGE_SIZE - 14, 22  # a line chart's rows (px) of the values 0 and 9
LINE_UNIT = (LINE_BASE - LINE_TOP) / 9  # pixels per unit of value


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
    pts = [(x, LINE_BASE - v * LINE_UNIT) for x, v in zip(LINE_XS, values)]
    c.line([(8, LINE_BASE), (IMAGE_SIZE - 6, LINE_BASE)], (40, 40, 40), width=2)
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


# Question phrasings, shared by the single-question samples and the training dialogues.
BAR_VALUE = ("What is the value of the {c} bar?", "What value does the {c} bar show?", "How high is the {c} bar?")
BAR_COUNT = ("How many bars are there?", "How many bars does the chart have?")
BAR_TALLEST = ("Which bar is the tallest?", "Which colour is the tallest bar?")
LINE_TREND = ("Does the line end higher or lower than it starts?", "Is the last point higher or lower than the first?")
LINE_PEAK = ("Which point of the line is the highest?", "At which point does the line peak?")
PIE_LARGEST = ("Which colour has the largest slice?", "Which slice of the pie is biggest?")
PIE_COUNT = ("How many slices does the pie have?", "How many slices are there?")


QUESTION_TYPES = {"bar": ("value", "count", "compare", "tallest"), "line": ("trend", "value", "highest"),
                  "pie": ("largest", "count")}


def question_type(kind: str, question: str) -> str:
    """The question type of a chart question (a key of QUESTION_TYPES[kind]) read back from its wording; ``kind`` is
    "bar", "line" or "pie"."""
    for qtype, phrasings in {"bar": (("value", BAR_VALUE), ("count", BAR_COUNT), ("tallest", BAR_TALLEST)),
                             "line": (("trend", LINE_TREND), ("highest", LINE_PEAK)),
                             "pie": (("largest", PIE_LARGEST), ("count", PIE_COUNT))}[kind]:
        if any(question.startswith(p.split("{")[0]) for p in phrasings):
            return qtype
    if kind == "bar" and question.startswith("Is the "):
        return "compare"
    if kind == "line" and question.startswith("What is the value of the "):
        return "value"
    raise ValueError(f"not a {kind} chart question: {question!r}")


def _tallest(colours: list[str], values: list[int]) -> str | None:
    return colours[values.index(max(values))] if values.count(max(values)) == 1 else None


def bar_question(rng: random.Random, qtype: str, colours: list[str], values: list[int], i: int = 0,
                 j: int = 1) -> tuple[str, str, int]:
    """(question, answer, n_choices) about a bar chart; ``i``/``j`` name the bars of "value" and "compare"."""
    if qtype == "value":
        return pick(rng, BAR_VALUE).format(c=colours[i]), str(values[i]), 9
    if qtype == "count":
        return pick(rng, BAR_COUNT), NUMBER_WORDS[len(colours)], 3
    if qtype == "compare":
        return (f"Is the {colours[i]} bar taller than the {colours[j]} bar?", "yes" if values[i] > values[j] else "no",
                2)
    best = _tallest(colours, values)
    if best is None:
        raise ValueError("no single tallest bar")
    return pick(rng, BAR_TALLEST), best, len(CHART_COLOURS)


def line_question(rng: random.Random, qtype: str, values: list[int], i: int = 0) -> tuple[str, str, int]:
    """(question, answer, n_choices) about a line chart; ``i`` names the point of "value"."""
    if qtype == "trend":
        if values[-1] == values[0]:
            raise ValueError("the line ends where it starts")
        return pick(rng, LINE_TREND), ("higher" if values[-1] > values[0] else "lower"), 2
    if qtype == "value":
        return f"What is the value of the {ORDINALS[i]} point?", str(values[i]), 9
    return pick(rng, LINE_PEAK), ORDINALS[values.index(max(values))], 5


def pie_question(rng: random.Random, qtype: str, colours: list[str], shares: list[int]) -> tuple[str, str, int]:
    """(question, answer, n_choices) about a pie chart: "largest" slice or slice "count"."""
    if qtype == "largest":
        return pick(rng, PIE_LARGEST), colours[shares.index(max(shares))], len(CHART_COLOURS)
    return pick(rng, PIE_COUNT), NUMBER_WORDS[len(colours)], 3


def make(rng: random.Random, suite: str, task: str) -> Sample:
    kind = pick(rng, ("bar", "bar", "line", "pie"))
    if kind == "bar":
        c, colours, values = _bar(rng)
        k = len(colours)
        qtype = pick(rng, ("value", "value", "count", "compare", "tallest"))
        if qtype == "tallest" and _tallest(colours, values) is None:
            qtype = "value"
        if qtype == "value":
            q, a, n = bar_question(rng, qtype, colours, values, rng.randrange(k))
        elif qtype == "compare":
            q, a, n = bar_question(rng, qtype, colours, values, *rng.sample(range(k), 2))
        else:
            q, a, n = bar_question(rng, qtype, colours, values)
        desc = sentence(f"a bar chart with {NUMBER_WORDS[k]} bars: " + join_list(
            rng, [f"{col} at {v}" for col, v in zip(colours, values)]) + ".")
    elif kind == "line":
        c, col, values = _line(rng)
        qtype = pick(rng, ("trend", "highest", "value"))
        if qtype == "trend" and values[-1] != values[0]:
            q, a, n = line_question(rng, "trend", values)
        elif qtype == "value":
            q, a, n = line_question(rng, "value", values, rng.randrange(5))
        else:
            q, a, n = line_question(rng, "highest", values)
        desc = sentence(f"a {col} line chart with five points: " + ", ".join(str(v) for v in values) + ".")
        colours = [col]
    else:
        c, colours, shares = _pie(rng)
        best = colours[shares.index(max(shares))]
        q, a, n = pie_question(rng, "largest" if rng.random() < 0.6 else "count", colours, shares)
        desc = sentence(f"a pie chart with {NUMBER_WORDS[len(colours)]} slices; the {best} slice is the largest.")
    pw = (c.patch_words(),)
    if task == "caption":
        return Sample(suite, f"chart_caption/{kind}", (c.image,), "<image>" + pick(rng, ("Describe the chart.", "What does this chart show?")),
                      desc, None, None, tuple(colours), pw)
    prompt = f"<image>{q} {pick(rng, SHORT_SUFFIX)}"
    return Sample(suite, f"chart/{kind}", (c.image,), prompt, a, a, n, (), pw)


def make_dialogue(rng: random.Random, suite: str, task: str, n_turns: int = 8) -> Sample:
    """A training dialogue: one chart, then up to ``n_turns`` distinct questions about it as successive turns.

    Every question type of the chart suite is asked about the same image (bar and point values, bar pairs, the
    tallest / peak / largest slice, counts), so one image's visual tokens train many readings; the first turn is in
    the evaluation format, half the follow-ups carry an answer-format suffix. Values are asked about two bars or
    points, not all of them: the turns then come in about the suite's own proportions (a line's value, peak and trend
    a third each; a bar chart's values two in five), where asking every value had made values most of the chart
    training and moved the LM's constant guesses (zoo/TRAINING.md, "Charts, image sets and clips as dialogues").
    """
    kind = pick(rng, ("bar", "bar", "line", "pie"))
    if kind == "bar":
        c, colours, values = _bar(rng)
        k = len(colours)
        pairs = [("compare", i, j) for i in range(k) for j in range(k) if i != j]
        rng.shuffle(pairs)
        asks = [("value", i, 0) for i in rng.sample(range(k), 2)] + [("count", 0, 0)] + pairs[:2]
        if _tallest(colours, values) is not None:
            asks.append(("tallest", 0, 0))
        ask = lambda qtype, i, j: bar_question(rng, qtype, colours, values, i, j)  # noqa: E731
    elif kind == "line":
        c, _, values = _line(rng)
        asks = [("value", i, 0) for i in rng.sample(range(5), 2)] + [("highest", 0, 0)]
        if values[-1] != values[0]:
            asks.append(("trend", 0, 0))
        ask = lambda qtype, i, j: line_question(rng, qtype, values, i)  # noqa: E731
    else:
        c, colours, shares = _pie(rng)
        asks = [("largest", 0, 0), ("count", 0, 0)]
        ask = lambda qtype, i, j: pie_question(rng, qtype, colours, shares)  # noqa: E731
    rng.shuffle(asks)
    turns = [ask(*a)[:2] for a in asks[:n_turns]]
    (q0, a0), rest = turns[0], turns[1:]
    followups = tuple((maybe_suffix(rng, q), a) for q, a in rest)
    return Sample(suite, f"chart_dialogue/{kind}", (c.image,), f"<image>{q0} {pick(rng, SHORT_SUFFIX)}", a0, a0, None,
                  (), (c.patch_words(),), followups)
