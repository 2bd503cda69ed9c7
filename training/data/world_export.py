"""The embedded world as a conversation file with PNG images: the generic ``specula train KIND --data FILE`` path
trained on the embedded target sees the same prompts the world's own recipes do.

    write_world_conversations("runs/world/train.jsonl", "runs/world/images",
                              world_samples(["vqa", "chart", "text"], n=1000))
    # specula train eagle --data runs/world/train.jsonl --image-root runs/world ...

Each record is ``{"id": "vqa-train-7", "image": "images/vqa-train-7-0.png", "conversations": [...]}``: a system turn
where the sample has one, the prompt (the world's ``<image>`` marks as they are), the reference response, then
every follow-up (question, answer). ``to_messages`` of the record read back renders, with the embedded chat
template, exactly ``world.tokenizer.format_dialogue(prompt, response, followups, system)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from specula.training.data.conversations import _relative, write_records


def world_samples(suites: Sequence[str] | None = None, n: int = 100, *, split: str = "train", start: int = 0,
                  seed: int = 0) -> Iterator[tuple[str, object]]:
    """(id, sample) for samples ``start .. start + n - 1`` of each suite (all suites by default)."""
    from specula.world.suites import SUITES, generate

    for suite in suites if suites is not None else list(SUITES):
        for i in range(start, start + n):
            yield f"{suite}-{split}-{i}", generate(suite, split, i, seed)


def sample_record(rid: str, sample, images: Sequence[str]) -> dict:
    """The file record of one world sample whose images were saved at ``images`` (paths as written in the file)."""
    turns = [{"from": "system", "value": sample.system}] if sample.system else []
    turns += [{"from": "human", "value": sample.prompt}, {"from": "gpt", "value": sample.response}]
    for q, a in sample.followups:
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    rec: dict = {"id": rid}
    if images:
        rec["image"] = images[0] if len(images) == 1 else list(images)
    rec["conversations"] = turns
    return rec


def write_world_conversations(out_file: str | Path, image_dir: str | Path, samples: Iterable, *,
                              image_root: str | Path | None = None, total: int | None = None,
                              progress: bool = True) -> int:
    """Writes ``samples`` (``(id, Sample)`` pairs or bare Samples) to ``out_file`` (JSONL if it ends in ``.jsonl``,
    else a JSON list), each image as ``image_dir/<id>-<k>.png``, named in the file relative to ``image_root``
    (default: the file's folder, what ``--image-root`` then is). Returns the number of records."""
    out = Path(out_file)
    folder = Path(image_dir)
    root = Path(image_root) if image_root is not None else out.parent
    folder.mkdir(parents=True, exist_ok=True)
    if total is None and hasattr(samples, "__len__"):
        total = len(samples)  # type: ignore[arg-type]

    def records() -> Iterator[dict]:
        for n, item in enumerate(samples):
            rid, s = item if isinstance(item, tuple) else (f"{item.suite}-{n}", item)
            stem = re.sub(r"[^\w.\-]", "_", rid)
            paths = []
            for k, im in enumerate(s.images):
                dest = folder / f"{stem}-{k}.png"
                im.convert("RGB").save(dest, format="PNG")
                paths.append(_relative(dest, root))
            yield sample_record(rid, s, paths)

    return write_records(out, records(), total=total, progress=progress, desc="exporting world samples")
