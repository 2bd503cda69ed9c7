"""Do a target's visual tokens carry the chart reading words? (``python -m research probe-charts``, ``words``)

``--chart-words`` (training/target/chart_words.py) has the vision stage regress a chart part's visual tokens onto codes that also
name what the part shows. This reads them back from held-out charts the way a lookup would: the projector's output
at the part (a bar or a slice: the mean over its patches; a point: its marker patch) against the word codes of each
candidate, nearest code wins:

- ``bar_value`` / ``point_value``: the value among the digits 0-9 (chance 1/9 over the values drawn);
- ``point_ordinal``: the ordinal among the five (chance 1/5);
- ``tallest`` / ``highest`` / ``largest``: the part whose tokens score highest on that word's code is the tallest
  bar / the peak / the largest slice (chance 1/k over a chart's k parts);
- the ``whole`` level's: ``bar_count`` / ``slice_count`` (each part: the number of parts among the number words
  two to five), ``trend`` (the last point: "higher" or "lower").

The shipped target (trained without the flag) reads them at about chance: 0.11, 0.21, 0.17, 0.23, 0.0, 0.18, 0.35,
0.18 and 0.58 in READINGS' order (``python -m research probe-charts --model target --n 50``: 100 charts, 201 bars, 100
points, 85 slices, 19 trends; zoo/TRAINING.md, "Chart reading words").
"""

from __future__ import annotations

import random

import torch

from specula.world import charts
from specula.world.vocab import NUMBER_WORDS, ORDINALS
from specula.training.target.chart_words import chart_reading_words
from specula.training.target.vision_heads import tower_features
from specula.training.target.word_codes import WordCodes

READINGS = ("bar_value", "point_value", "point_ordinal", "tallest", "highest", "largest", "bar_count", "slice_count",
            "trend")
DIGITS = tuple(str(d) for d in range(10))
COUNTS = NUMBER_WORDS[2:6]  # two .. five: every count of bars (3-5) and slices (2-4)
TRENDS = ("higher", "lower")


class _Reader:
    """Nearest-code readings of one model's visual tokens, tallied per reading."""

    def __init__(self, dim: int, code_seed: int):
        self.codes = WordCodes(dim, code_seed)
        self.hits = {r: [0, 0] for r in READINGS}

    def tally(self, reading: str, ok: bool) -> None:
        self.hits[reading][0] += int(ok)
        self.hits[reading][1] += 1

    def nearest(self, token: torch.Tensor, words: tuple[str, ...]) -> str:
        """The word of ``words`` whose code scores highest on ``token`` [H]."""
        scores = torch.stack([self.codes.code(w) for w in words]) @ token  # [K]
        return words[int(scores.argmax())]

    def best_part(self, parts: dict[str, torch.Tensor], word: str) -> str:
        """The part (name -> token [H]) scoring highest on ``word``'s code."""
        code = self.codes.code(word)
        return max(parts, key=lambda p: float(parts[p] @ code))

    def report(self) -> dict:
        return {r: {"n": b, "accuracy": round(a / b, 4) if b else None} for r, (a, b) in self.hits.items()}


def _parts(words, tokens: torch.Tensor, part: str) -> dict[str, tuple[tuple[str, ...], torch.Tensor]]:
    """colour -> (the part's words, its mean token [H]) for the bars or slices of a chart."""
    where: dict[str, list[int]] = {}
    for t, w in enumerate(words):
        if len(w) > 2 and w[1] == part:
            where.setdefault(w[0], []).append(t)
    return {c: (words[ts[0]], tokens[ts].mean(0)) for c, ts in where.items()}


def word_readout(model, processor, n: int = 60, seed: int = 0, code_seed: int = 0) -> dict:
    """Accuracy of each reading in READINGS over ``n`` held-out chart questions' charts."""
    r = _Reader(model.config.text_config.hidden_size, code_seed)
    for i in range(n):
        s = charts.make(random.Random(f"probe-chart-words/{seed}/{i}"), "chart", "qa")
        chart = s.kind.split("/")[1]
        words = chart_reading_words(s.kind, s.patch_words[0], s.images[0], "whole")
        pixels = processor.image_processor(images=[s.images[0]], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            tokens = tower_features(model, pixels.to(model.device, model.dtype))[1][0].float().cpu()  # [T, H]
        if chart in ("bar", "pie"):
            parts = _parts(words, tokens, "bar" if chart == "bar" else "slice")
            for w, token in parts.values():
                if chart == "bar" and w[2].isdigit():
                    r.tally("bar_value", r.nearest(token, DIGITS) == w[2])
                count = next(x for x in w[2:] if x in COUNTS)
                r.tally(f"{'bar' if chart == 'bar' else 'slice'}_count", r.nearest(token, COUNTS) == count)
            word = "tallest" if chart == "bar" else "largest"
            truth = [c for c, (w, _) in parts.items() if word in w]
            if truth:
                r.tally(word, r.best_part({c: tok for c, (_, tok) in parts.items()}, word) == truth[0])
        else:
            points = {w[2]: (w, tokens[t]) for t, w in enumerate(words) if len(w) > 3 and w[1] == "point"}
            for ordinal, (w, token) in points.items():
                r.tally("point_value", r.nearest(token, DIGITS) == w[3])
                r.tally("point_ordinal", r.nearest(token, ORDINALS[:len(charts.LINE_XS)]) == ordinal)
                if w[-1] in TRENDS:
                    r.tally("trend", r.nearest(token, TRENDS) == w[-1])
            truth = [o for o, (w, _) in points.items() if "highest" in w]
            if truth:
                r.tally("highest", r.best_part({o: tok for o, (_, tok) in points.items()}, "highest") == truth[0])
    return r.report()
