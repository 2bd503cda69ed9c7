"""Chart reading words: what a chart part shows, written onto the part's own patches for the vision targets.

From exact word codes in place of the image the LM answered chart questions no better than from a blank image
(zoo/TRAINING.md, "Shipped, and what the LM cannot read yet"), and attention targets that walk its heads from a bar
to the number printed above it formed their hops without moving the answers (training/target/chart_referents.py). A
bar's value sits on other patches than the bar: reading it is a lookup (the bar, by its colour) and then a geometric
hop (the number above it), which the LM does not learn from a few thousand chart answers. Scene questions, which it
reads, are one lookup: the asked object's patches carry the answer (its colour or shape code).

``chart_reading_words`` turns chart questions into that form. It adds to each part's patch words what the part
shows, so that the vision stage (which regresses the tower onto word codes) teaches the tower to carry it there:

- ``parts`` (what one part shows): a bar's patches its value (the number printed above it) and, on the tallest bar,
  ``"tallest"``; a line point's marker patch its ordinal (``"third"``), its value and, on the peak, ``"highest"``;
- ``whole`` (``parts`` plus what the chart as a whole shows, on its parts): every bar's and every slice's patches
  the number of bars or slices (``"four"``), the largest slice's ``"largest"``, and the last point's marker whether
  the line ends ``"higher"`` or ``"lower"`` than it starts.

A bar's value is the digit whose patches lie in the bar's columns; a line point is found from the drawing (the
line's colour at the point's column: markers often cover under a quarter of every patch); counts and the largest
slice come from the pixels of each chart colour. So the world's samples do not change. A bar whose number covers no
patch gets no value, and a chart with a bar of unknown value gets no ``"tallest"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specula.world.charts import CHART_COLOURS, LINE_BASE, LINE_UNIT, LINE_XS
from specula.world.sample import GRID, PATCH
from specula.world.vocab import COLOURS, NUMBER_WORDS, ORDINALS

PatchWords = tuple[tuple[str, ...], ...]
LEVELS = ("parts", "whole")
MIN_PIXELS = 40  # a chart colour drawn on fewer pixels is not counted as a part (antialiasing never reaches it)


def _digit(words: tuple[str, ...]) -> str | None:
    return words[0] if len(words) == 1 and words[0].isdigit() else None


def _digits_in(patch_words: Sequence[tuple[str, ...]], cols: set[int], max_row: int) -> list[str]:
    """The digits covering patches in ``cols`` at rows <= ``max_row``, nearest row first."""
    found = [(t // GRID, d) for t, w in enumerate(patch_words) if (d := _digit(w)) is not None
             and t % GRID in cols and t // GRID <= max_row]
    return [d for _, d in sorted(found, key=lambda rd: -rd[0])]


def _bar_words(patch_words: Sequence[tuple[str, ...]]) -> dict[int, tuple[str, ...]]:
    bars: dict[str, list[int]] = {}
    for t, w in enumerate(patch_words):
        if len(w) == 2 and w[1] == "bar":
            bars.setdefault(w[0], []).append(t)
    values: dict[str, str] = {}
    for colour, patches in bars.items():
        cols = {t % GRID for t in patches}
        top = min(t // GRID for t in patches)
        digits = _digits_in(patch_words, cols, top)
        if digits:
            values[colour] = digits[0]
    extra: dict[int, tuple[str, ...]] = {}
    tallest = None
    if values and len(values) == len(bars):
        best = max(int(v) for v in values.values())
        if sum(int(v) == best for v in values.values()) == 1:
            tallest = next(c for c, v in values.items() if int(v) == best)
    for colour, patches in bars.items():
        words = ((values[colour],) if colour in values else ()) + (("tallest",) if colour == tallest else ())
        for t in patches:
            extra[t] = tuple(patch_words[t]) + words
    return extra


def _colour_masks(image) -> dict[str, np.ndarray]:
    """Where each chart colour is drawn  # [H, W] bool each; exact up to rounding: the background's noise is on the
    background alone and never reaches a chart colour."""
    a = np.asarray(image.convert("RGB"), dtype=np.int16)  # [H, W, 3]
    return {c: (np.abs(a - np.array(COLOURS[c])).sum(-1) < 12) for c in CHART_COLOURS}


def _line_points(near: dict[str, np.ndarray]) -> tuple[str, list[float]] | None:
    """(the line's colour, each point's centre row in pixels) read from the colour masks: at a point's column the
    marker and the line are the only pixels of the line's colour, so their middle row is the marker's centre. None
    when a point cannot be found."""
    colour = max(near, key=lambda c: int(near[c].sum()))
    rows = []
    for x in LINE_XS:
        ys = np.nonzero(near[colour][:, int(round(x))])[0]
        if ys.size == 0:
            return None
        rows.append(float(ys.min() + ys.max()) / 2)
    return colour, rows


def _line_words(found: tuple[str, list[float]] | None) -> dict[int, tuple[str, ...]]:
    """The marker patches' words from ``_line_points``' reading."""
    if found is None:
        return {}
    colour, rows = found
    values = [round((LINE_BASE - y) / LINE_UNIT) for y in rows]
    best = max(values)
    peak = values.index(best) if values.count(best) == 1 else None
    extra: dict[int, tuple[str, ...]] = {}
    for i, (x, y) in enumerate(zip(LINE_XS, rows)):
        t = int(y // PATCH) * GRID + int(x // PATCH)  # the patch under the marker's centre
        words = (ORDINALS[i], str(values[i])) + (("highest",) if i == peak else ())
        extra[t] = (colour, "point") + words
    return extra


def _whole_words(chart: str, words: list[tuple[str, ...]], near: dict[str, np.ndarray],
                 found: tuple[str, list[float]] | None) -> None:
    """Append the chart-wide words of ``whole`` to ``words`` (the ``parts`` words, one tuple per patch) in place;
    ``near``: the colour masks, ``found``: a line chart's ``_line_points``."""
    pixels = {c: int(m.sum()) for c, m in near.items()}
    drawn = [c for c, n in pixels.items() if n >= MIN_PIXELS]
    if chart in ("bar", "pie"):
        part = "bar" if chart == "bar" else "slice"
        count = NUMBER_WORDS[len(drawn)]
        largest = max(drawn, key=pixels.get) if chart == "pie" and drawn else None
        for t, w in enumerate(words):
            if len(w) >= 2 and w[1] == part:
                words[t] = w + (count,) + (("largest",) if w[0] == largest else ())
    elif chart == "line":
        if found is None:
            return
        first, last = found[1][0], found[1][-1]  # marker rows: a smaller row is higher
        if abs(first - last) >= LINE_UNIT / 2:
            for t, w in enumerate(words):
                if w[1:3] == ("point", ORDINALS[len(LINE_XS) - 1]):
                    words[t] = w + ("higher" if last < first else "lower",)


def chart_reading_words(kind: str, patch_words: Sequence[tuple[str, ...]], image, level: str = "parts") -> PatchWords:
    """One chart image's patch words with its parts' reading words at ``level`` (LEVELS); ``kind`` is a sample's kind
    (``chart/bar``, ``chart_dialogue/line``, ``chart_caption/pie``, ...), ``image`` its PIL image. Other kinds come
    back unchanged."""
    if level not in LEVELS:
        raise ValueError(f"chart words level must be one of {LEVELS}, got {level!r}")
    family, _, chart = kind.partition("/")
    if family not in ("chart", "chart_dialogue", "chart_caption"):
        return tuple(patch_words)
    near = _colour_masks(image) if chart == "line" or level == "whole" else {}
    found = _line_points(near) if chart == "line" else None
    new = _bar_words(patch_words) if chart == "bar" else _line_words(found)
    words = [new.get(t, tuple(w)) for t, w in enumerate(patch_words)]
    if level == "whole":
        _whole_words(chart, words, near, found)
    return tuple(words)
