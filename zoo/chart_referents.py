"""Chart referents: the lookup hops of a scene question, asked of a chart's bars, points and slices.

Charts stay near their blank-image level while one-image scenes are read (zoo/TRAINING.md, "Chart referents (stop
56)"), and from exact word codes in place of the image the LM answered them no better (stop 25): the LM does not pick
the part of the chart a question is about. A value question ("What is the value of the red bar?") is the two-hop
lookup that ``zoo/referents.py`` supervises for scenes: fetch the question's referent word ("red", "third"), then
attend to that part's patches and copy what they hold (here the number printed above it). So ``chart_referent_targets``
gives the same two heads (head 0 of ``WORD_LAYER`` on the referent word, head 0 of ``PATCH_LAYER`` on the patches)
these targets, group ``"chart"``, weighted by ``--chart-referents``:

- a bar's value: the word hop on the bar's colour, the patch hop on the number printed above it (the number's patches
  in the bar's columns; the bar's own top patches when the number covers none);
- a line point's value: the word hop on the ordinal, the patch hop on that point's marker and the number above it;
- the tallest bar, the line's peak, the largest slice: no word hop (the question names no part), the patch hop on
  the answer's bar, point or slice: the part whose colour or place the answer says.

Questions that compare two parts (taller, trend) or count them have no single referent and get none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from specula.world.charts import CHART_COLOURS, LINE_XS
from specula.world.sample import GRID, PATCH, Sample
from specula.world.vocab import ORDINALS
from specula.zoo.referents import ReferentTarget, answer_spans

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


def _turn_target(q: str, a: str, kind: str, patch_words: Sequence[tuple[str, ...]],
                 words_in: Callable[[str], tuple[int, ...]]) -> tuple[list[int], tuple[int, ...]] | None:
    """(patches, referent word positions) of one question about a chart, or None when it has no single referent."""
    ql, answer = q.lower(), a.strip(" .").lower()
    if kind == "bar":
        m = _BAR_VALUE.search(ql)
        if m and m.group(3) in CHART_COLOURS:
            return bar_patches(patch_words, m.group(3), label=True), words_in(m.group(3))
        if "tallest" in ql and answer in CHART_COLOURS:
            return bar_patches(patch_words, answer, label=False), ()
    elif kind == "line":
        m = _POINT_VALUE.search(ql)
        if m and m.group(1) in ORDINALS[:len(LINE_XS)]:
            return point_patches(patch_words, ORDINALS.index(m.group(1)), label=True), words_in(m.group(1))
        if any(w in ql for w in _SUPERLATIVE) and answer in ORDINALS[:len(LINE_XS)]:
            return point_patches(patch_words, ORDINALS.index(answer), label=False), ()
    elif kind == "pie" and any(w in ql for w in _SUPERLATIVE) and answer in CHART_COLOURS:
        return [t for t, w in enumerate(patch_words) if w[:2] == (answer, "slice")], ()
    return None


def chart_referent_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor, image_id: int,
                           word_id: Callable[[str], int]) -> tuple[ReferentTarget, ...]:
    """The lookup turns of a one-chart sample (``chart/<kind>`` questions and ``chart_dialogue/<kind>`` dialogues),
    in order, as group ``"chart"`` targets; () for anything else or when the image tokens do not match the image.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns); ``word_id(w)`` a word's single token
    id or -1.
    """
    family, _, kind = s.kind.partition("/")
    if family not in ("chart", "chart_dialogue") or len(s.images) != 1 or not s.patch_words:
        return ()
    image_pos = (input_ids == image_id).nonzero()[:, 0].tolist()
    if len(image_pos) != len(s.patch_words[0]):
        return ()
    ids = input_ids.tolist()
    starts, ends = answer_spans(labels)
    turns = [(s.prompt.replace("<image>", ""), s.response)] + list(s.followups)
    out = []
    for i, ((q, a), start) in enumerate(zip(turns, starts)):
        prev = ends[i - 1] if i > 0 and i - 1 < len(ends) else 0  # the question's turn starts after the last answer

        def words_in(word: str, lo: int = prev, hi: int = start) -> tuple[int, ...]:
            wid = word_id(word)
            return tuple(j for j in range(lo, hi) if ids[j] == wid) if wid >= 0 else ()

        found = _turn_target(q, a, kind, s.patch_words[0], words_in)
        if found and found[0]:
            out.append(ReferentTarget(start - 1, tuple(image_pos[t] for t in found[0]), found[1], group="chart"))
    return tuple(out)
