"""Drawing primitives: shapes on a canvas plus an object-id map, turned into per-patch word labels."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from specula.world.sample import GRID, IMAGE_SIZE, PATCH


@lru_cache(maxsize=16)
def font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's built-in scalable font: the same glyphs on every machine, nothing to download."""
    return ImageFont.load_default(size=size)


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Polygon vertices for a shape of bounding radius r centred at (cx, cy); None for a circle."""
    if shape == "circle":
        return None
    if shape == "square":
        s = r * 0.88
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    if shape == "cross":
        w = r * 0.36
        return [
            (cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w), (cx + w, cy + w),
            (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w), (cx - r, cy - w), (cx - w, cy - w),
        ]
    raise ValueError(f"unknown shape {shape!r}")


@dataclass
class Canvas:
    """An RGB image and, beside it, an int map of which labelled thing covers each pixel (-1 = background)."""

    image: Image.Image
    ids: Image.Image  # mode "I": object index per pixel
    labels: list[tuple[str, ...]]

    @classmethod
    def new(cls, rgb: tuple[int, int, int], rng: random.Random, noise: float = 6.0) -> "Canvas":
        arr = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
        arr[:] = rgb
        if noise > 0:
            nrng = np.random.default_rng(rng.getrandbits(63))
            arr += nrng.normal(0.0, noise, size=arr.shape).astype(np.float32)
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
        ids = Image.new("I", (IMAGE_SIZE, IMAGE_SIZE), -1)
        return cls(img, ids, [])

    def _label(self, words: tuple[str, ...]) -> int:
        self.labels.append(words)
        return len(self.labels) - 1

    def shape(self, shape: str, cx: float, cy: float, r: float, rgb: tuple[int, int, int], words: tuple[str, ...]) -> None:
        idx = self._label(words)
        draw, idraw = ImageDraw.Draw(self.image), ImageDraw.Draw(self.ids)
        poly = shape_polygon(shape, cx, cy, r)
        outline = (0, 0, 0) if sum(rgb) > 300 else (235, 235, 235)
        if poly is None:
            box = (cx - r, cy - r, cx + r, cy + r)
            draw.ellipse(box, fill=rgb, outline=outline)
            idraw.ellipse(box, fill=idx)
        else:
            draw.polygon(poly, fill=rgb, outline=outline)
            idraw.polygon(poly, fill=idx)

    def rect(self, box: tuple[float, float, float, float], rgb: tuple[int, int, int], words: tuple[str, ...]) -> None:
        idx = self._label(words)
        ImageDraw.Draw(self.image).rectangle(box, fill=rgb)
        ImageDraw.Draw(self.ids).rectangle(box, fill=idx)

    def pie(self, box, start: float, end: float, rgb, words: tuple[str, ...]) -> None:
        idx = self._label(words)
        ImageDraw.Draw(self.image).pieslice(box, start, end, fill=rgb, outline=(30, 30, 30))
        ImageDraw.Draw(self.ids).pieslice(box, start, end, fill=idx)

    def text(self, xy: tuple[float, float], s: str, size: int, rgb, words: tuple[str, ...] = (), anchor: str = "mm") -> None:
        f = font(size)
        draw = ImageDraw.Draw(self.image)
        draw.text(xy, s, fill=rgb, font=f, anchor=anchor)
        if words:
            idx = self._label(words)
            ImageDraw.Draw(self.ids).rectangle(draw.textbbox(xy, s, font=f, anchor=anchor), fill=idx)

    def line(self, pts, rgb, width: int = 3) -> None:
        ImageDraw.Draw(self.image).line(pts, fill=rgb, width=width)

    def patch_words(self) -> tuple[tuple[str, ...], ...]:
        """Per patch (row-major, GRID*GRID), the words of the thing covering most of it, or () if background."""
        ids = np.asarray(self.ids, dtype=np.int32).reshape(GRID, PATCH, GRID, PATCH).transpose(0, 2, 1, 3)
        ids = ids.reshape(GRID * GRID, PATCH * PATCH)  # [144, 196]
        out = []
        for row in ids:
            fg = row[row >= 0]
            if fg.size * 4 < row.size:  # under a quarter covered: background
                out.append(())
                continue
            out.append(self.labels[int(np.bincount(fg).argmax())])
        return tuple(out)
