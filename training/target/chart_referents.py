"""Chart referents: a chart question about one part of the chart, read as a lookup of that part and then of its number.

Charts stay near their blank-image level while one-image scenes are read (zoo/TRAINING.md, "Counting and the odd one
out on the suites mix; chart referents"), and from exact word codes in place of the image the LM answered them no
better (zoo/TRAINING.md, "Shipped, and what the LM cannot read yet"): the LM does not pick
the part of the chart a question is about, or does not read the number printed on it. ``chart_referent_targets``
gives attention targets of group ``"chart"`` (weighted by ``--chart-referents``) at the position that predicts the
answer:

- a bar's value: the scene lookup's two hops (head 0 of ``WORD_LAYER`` on the bar's colour word, head 0 of
  ``PATCH_LAYER`` on the bar's patches), and the number hop: head ``NUMBER_HEAD`` of ``NUMBER_LAYER`` on the number
  printed above the bar (the number's patches in the bar's columns; the bar's top row when the number covers none);
- a line point's value: the patch hop on the point's marker, the number hop on the number above it (when it covers
  a patch); no word hop: the scene word head puts all its mass on colour and shape words and exactly none (fp32
  underflow) on an ordinal, so -log of it is floored and has no gradient;
- the tallest bar, the line's peak, the largest slice: the patch hop alone on the answer's bar, point or slice (the
  question names no part; the part's colour or place is the answer).

Why the number has a hop of its own, two layers up: in the shipped target no layer-1 head puts more than 0.002 of its
mass on a bar's number at a value answer, while head 0 of layer 1 gives the asked bar 0.19 and head 3 of layer 3
gives the number 0.16 (``python -m research probe-charts``, 30 answers). A first version asked the layer-1 lookup head
for the number itself: its loss stayed near -log 0.001 and the charts fell (0.39 -> 0.31 on 150).

Questions that compare two parts (taller, trend) or count them have no single referent and get none (but see
``whole`` below).

With the chart reading words (``--chart-words``, training/target/chart_words.py) a part's own tokens carry its value, ordinal
and superlative, so a value question is the scene lookup alone: ``reading`` (the level of the words) drops the
number hop and finds a line point by the marker patch its reading words name (found from the drawing, also where the
marker covers under a quarter of every patch). At the ``whole`` level every bar and slice also names how many there
are and the last point the line's trend, so those questions get a lookup too: onto every bar or slice, or onto the
last point.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from specula.world.charts import CHART_COLOURS, LINE_XS, question_type
from specula.world.sample import GRID, PATCH, Sample
from specula.world.vocab import ORDINALS
from specula.training.target.chart_words import chart_reading_words
from specula.training.target.referents import ReferentTarget, answer_spans

NUMBER_LAYER, NUMBER_HEAD = 3, 3  # the head that reads a part's printed number (it already gives it 0.16)

_BAR_VALUE = re.compile(r"(value (of|does) the|how high is the) (\w+) bar")
_POINT_VALUE = re.compile(r"value of the (\w+) point")
_SUPERLATIVE = ("tallest", "highest", "peak", "largest", "biggest")


def _is_number(words: tuple[str, ...]) -> bool:
    return len(words) == 1 and words[0].isdigit()


def _columns(patch_words: Sequence[tuple[str, ...]], part: tuple[str, str]) -> set[int]:
    return {t % GRID for t, w in enumerate(patch_words) if w[:2] == part}


def bar_patches(patch_words: Sequence[tuple[str, ...]], colour: str, label: bool) -> list[int]:
    """The patches of the number above the ``colour`` bar (``label``; the bar's top row of patches when the number
    covers none), or the bar's own patches."""
    bar = [t for t, w in enumerate(patch_words) if w[:2] == (colour, "bar")]
    if not label or not bar:
        return bar
    cols = _columns(patch_words, (colour, "bar"))
    number = [t for t, w in enumerate(patch_words) if _is_number(w) and t % GRID in cols]
    top = min(t // GRID for t in bar)
    return number or [t for t in bar if t // GRID == top]


def point_patches(patch_words: Sequence[tuple[str, ...]], i: int, label: bool) -> list[int]:
    """The marker patches of a line chart's ``i``-th point (the point's column, from ``LINE_XS``), and with
    ``label`` the number patches in and beside that column above the marker."""
    col = int(LINE_XS[i] // PATCH)
    marker = [t for t, w in enumerate(patch_words) if len(w) == 2 and w[1] == "point" and abs(t % GRID - col) <= 1]
    if not label or not marker:
        return marker
    top = min(t // GRID for t in marker)
    number = [t for t, w in enumerate(patch_words) if _is_number(w) and abs(t % GRID - col) <= 1 and t // GRID <= top]
    return marker + number


def _reading_point(patch_words: Sequence[tuple[str, ...]], ordinal: str) -> list[int]:
    """The marker patch that the reading words (training/target/chart_words.py) name with ``ordinal``."""
    return [t for t, w in enumerate(patch_words) if w[1:3] == ("point", ordinal)]


def _whole_target(q: str, answer: str, kind: str, patch_words: Sequence[tuple[str, ...]]) -> list[int]:
    """The parts whose ``whole`` reading words carry the answer of a count or trend question; [] for other questions."""
    qtype = question_type(kind, q)
    if qtype == "count":
        return [t for t, w in enumerate(patch_words) if w[1:2] in (("bar",), ("slice",)) and answer in w[2:]]
    if qtype == "trend":
        return [t for t, w in enumerate(patch_words) if w[1:2] == ("point",) and w[-1] == answer]
    return []


def _turn_target(q: str, a: str, kind: str, patch_words: Sequence[tuple[str, ...]],
                 words_in: Callable[[str], tuple[int, ...]], reading: str = ""
                 ) -> list[tuple[list[int], tuple[int, ...], bool]]:
    """The hops of one question about a chart: (patches, referent word positions, is the number hop) each; [] when
    it has no single referent. ``reading``: ``patch_words`` are the reading words of that level; no number hop."""
    ql, answer = q.lower(), a.strip(" .").lower()
    if reading == "whole" and (whole := _whole_target(q, answer, kind, patch_words)):
        return [(whole, (), False)]
    if kind == "bar":
        m = _BAR_VALUE.search(ql)
        if m and m.group(3) in CHART_COLOURS:
            colour = m.group(3)
            lookup = (bar_patches(patch_words, colour, label=False), words_in(colour), False)
            return [lookup] if reading else [lookup, (bar_patches(patch_words, colour, label=True), (), True)]
        if "tallest" in ql and answer in CHART_COLOURS:
            return [(bar_patches(patch_words, answer, label=False), (), False)]
    elif kind == "line":
        m = _POINT_VALUE.search(ql)
        if m and m.group(1) in ORDINALS[:len(LINE_XS)] and reading:
            return [(_reading_point(patch_words, m.group(1)), (), False)]
        if m and m.group(1) in ORDINALS[:len(LINE_XS)]:
            i = ORDINALS.index(m.group(1))
            marker = point_patches(patch_words, i, label=False)
            number = [t for t in point_patches(patch_words, i, label=True) if t not in marker]
            return [(marker, (), False), (number, (), True)]  # no word hop: see the module's docstring
        if any(w in ql for w in _SUPERLATIVE) and answer in ORDINALS[:len(LINE_XS)]:
            if reading:
                return [(_reading_point(patch_words, answer), (), False)]
            return [(point_patches(patch_words, ORDINALS.index(answer), label=False), (), False)]
    elif kind == "pie" and any(w in ql for w in _SUPERLATIVE) and answer in CHART_COLOURS:
        return [([t for t, w in enumerate(patch_words) if w[:2] == (answer, "slice")], (), False)]
    return []


def chart_referent_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor, image_id: int,
                           word_id: Callable[[str], int], reading: str = "") -> tuple[ReferentTarget, ...]:
    """The lookup turns of a one-chart sample (``chart/<kind>`` questions and ``chart_dialogue/<kind>`` dialogues),
    in order, as group ``"chart"`` targets; () for anything else or when the image tokens do not match the image.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns); ``word_id(w)`` a word's single token
    id or -1. ``reading``: the targets of a run with the chart reading words of that level (the module's docstring).
    """
    family, _, kind = s.kind.partition("/")
    if family not in ("chart", "chart_dialogue") or len(s.images) != 1 or not s.patch_words:
        return ()
    image_pos = (input_ids == image_id).nonzero()[:, 0].tolist()
    if len(image_pos) != len(s.patch_words[0]):
        return ()
    ids = input_ids.tolist()
    patch_words = chart_reading_words(s.kind, s.patch_words[0], s.images[0], reading) if reading else s.patch_words[0]
    starts, ends = answer_spans(labels)
    turns = [(s.prompt.replace("<image>", ""), s.response)] + list(s.followups)
    out = []
    for i, ((q, a), start) in enumerate(zip(turns, starts)):
        prev = ends[i - 1] if i > 0 and i - 1 < len(ends) else 0  # the question's turn starts after the last answer

        def words_in(word: str, lo: int = prev, hi: int = start) -> tuple[int, ...]:
            wid = word_id(word)
            return tuple(j for j in range(lo, hi) if ids[j] == wid) if wid >= 0 else ()

        for patches, words, number in _turn_target(q, a, kind, patch_words, words_in, reading):
            if not patches:  # a marker or number under a quarter of any patch
                continue
            hop = dict(patch_layer=NUMBER_LAYER, head=NUMBER_HEAD) if number else {}
            out.append(ReferentTarget(start - 1, tuple(image_pos[t] for t in patches), words, group="chart", **hop))
    return tuple(out)
