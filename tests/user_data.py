"""A user's training data as the trainers take it: a small LLaVA-Instruct / ShareGPT4V conversation file (JSONL) with
PNG images beside it (docs/training-data.md). Built by the session fixture ``conversations_file`` (tests/conftest.py);
``build_conversations`` for a test that needs its own copy.

Records mix one-image, two-image and text-only conversations, single and multi-turn, with answers of a few words to
a sentence, so every split a recipe reads (train / text / vision / eval) is non-empty."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = ["circle", "square", "triangle", "star"]
COLOURS = [("red", (220, 30, 30)), ("blue", (30, 60, 220)), ("green", (30, 180, 60)), ("yellow", (230, 210, 40))]


def _png(path: Path, rgb: tuple[int, int, int], size: tuple[int, int], seed: int) -> None:
    """A picture of one colour block on a white background, at a size the processor must resize."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    w, h = size
    x0, y0 = (seed * 7) % (w // 2), (seed * 5) % (h // 2)
    ImageDraw.Draw(img).rectangle([x0, y0, x0 + w // 2, y0 + h // 2], fill=rgb)
    img.save(path)


def build_conversations(folder: str | Path, n: int = 24) -> Path:
    """``folder``/images/*.png and ``folder``/conversations.jsonl of ``n`` records; returns the file."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        colour, rgb = COLOURS[i % len(COLOURS)]
        shape = SHAPES[(i // 2) % len(SHAPES)]
        kind = i % 4  # 0, 1: one image; 2: two images, two turns; 3: text only
        if kind in (0, 1):
            name = f"images/{i:03d}.png"
            _png(folder / name, rgb, (40 + 8 * (i % 3), 32 + 8 * (i % 2)), i)
            ask = "Describe the image." if kind == 0 else "What colour is the square? Answer with one word."
            answer = (f"A {colour} {shape} is to the left of a white background." if kind == 0
                      else colour.capitalize() + ".")
            records.append({"id": f"r{i}", "image": name,
                            "conversations": [{"from": "human", "value": f"<image>\n{ask}"},
                                              {"from": "gpt", "value": answer}]})
        elif kind == 2:
            names = [f"images/{i:03d}a.png", f"images/{i:03d}b.png"]
            _png(folder / names[0], rgb, (48, 40), i)
            _png(folder / names[1], COLOURS[(i + 1) % len(COLOURS)][1], (40, 48), i + 1)
            records.append({"id": f"r{i}", "image": names, "conversations": [
                {"from": "human", "value": "<image>\n<image>\nLook at the images in order and describe what changes."},
                {"from": "gpt", "value": f"The {colour} square is now {COLOURS[(i + 1) % 4][0]}."},
                {"from": "human", "value": "How many squares are there in the picture?"},
                {"from": "gpt", "value": "There are two squares."}]})
        else:
            records.append({"id": f"r{i}", "conversations": [
                {"from": "system", "value": "You are a helpful assistant."},
                {"from": "human", "value": f"What colour is the {shape}? Answer with one word."},
                {"from": "gpt", "value": colour.capitalize() + "."}]})
    out = folder / "conversations.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out
