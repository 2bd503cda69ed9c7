"""Do a target's visual tokens carry the chart reading words? (``specula zoo probe-charts``, ``words``; stop 57)

``--chart-words`` (zoo/chart_words.py) has the vision stage regress a chart part's visual tokens onto codes that also
name what the part shows. This reads them back from held-out bar and line charts the way a lookup would: the
projector's output at the part (a bar: the mean over its patches; a point: its marker patch) against the word codes
of each candidate, nearest code wins:

- ``bar_value`` / ``point_value``: the value among the digits 0-9 (chance 1/9 over the values drawn);
- ``point_ordinal``: the ordinal among the five (chance 1/5);
- ``tallest`` / ``highest``: the part whose tokens score highest on that word's code is the tallest bar / the peak
  (chance 1/k over a chart's k parts).

The shipped target (trained without the flag) reads them at about chance: 0.11, 0.21, 0.17, 0.23 and 0.0 in that
order (``specula zoo probe-charts --model target --n 50``: 100 charts, 201 bars, 100 points; stop 57).
"""

from __future__ import annotations

import random

import torch

from specula.world import charts
from specula.world.vocab import ORDINALS
from specula.zoo.chart_words import chart_reading_words
from specula.zoo.vision_heads import tower_features
from specula.zoo.word_codes import WordCodes

READINGS = ("bar_value", "point_value", "point_ordinal", "tallest", "highest")
DIGITS = tuple(str(d) for d in range(10))


def _score(tokens: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """tokens [..., H], codes [K, H] -> [..., K] dot products"""
    return tokens @ codes.T


def word_readout(model, processor, n: int = 60, seed: int = 0, code_seed: int = 0) -> dict:
    """Accuracy of each reading in READINGS over the bar and line charts among ``n`` held-out chart questions."""
    codes = WordCodes(model.config.text_config.hidden_size, code_seed)
    digits = torch.stack([codes.code(d) for d in DIGITS])  # [10, H]
    ordinals = torch.stack([codes.code(o) for o in ORDINALS[:len(charts.LINE_XS)]])  # [5, H]
    tallest, highest = codes.code("tallest"), codes.code("highest")  # [H] each
    hits = {r: [0, 0] for r in READINGS}

    def count(reading: str, ok: bool) -> None:
        hits[reading][0] += int(ok)
        hits[reading][1] += 1

    for i in range(n):
        s = charts.make(random.Random(f"probe-chart-words/{seed}/{i}"), "chart", "qa")
        chart = s.kind.split("/")[1]
        if chart == "pie":
            continue
        words = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
        pixels = processor.image_processor(images=[s.images[0]], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            tokens = tower_features(model, pixels.to(model.device, model.dtype))[1][0].float().cpu()  # [T, H]
        if chart == "bar":
            bars: dict[str, list[int]] = {}
            for t, w in enumerate(words):
                if len(w) > 2 and w[1] == "bar":
                    bars.setdefault(w[0], []).append(t)
            on_tallest = {}
            for colour, patches in bars.items():
                mean = tokens[patches].mean(0)  # [H]
                count("bar_value", DIGITS[int(_score(mean, digits).argmax())] == words[patches[0]][2])
                on_tallest[colour] = float(mean @ tallest)
            truth = [c for c, p in bars.items() if "tallest" in words[p[0]]]
            if truth:
                count("tallest", max(on_tallest, key=on_tallest.get) == truth[0])
        else:
            points = [(t, w) for t, w in enumerate(words) if len(w) > 3 and w[1] == "point"]
            on_highest = {}
            for t, w in points:
                count("point_value", DIGITS[int(_score(tokens[t], digits).argmax())] == w[3])
                count("point_ordinal", ORDINALS[int(_score(tokens[t], ordinals).argmax())] == w[2])
                on_highest[w[2]] = float(tokens[t] @ highest)
            truth = [w[2] for _, w in points if "highest" in w]
            if truth:
                count("highest", max(on_highest, key=on_highest.get) == truth[0])
    return {r: {"n": b, "accuracy": round(a / b, 4) if b else None} for r, (a, b) in hits.items()}
