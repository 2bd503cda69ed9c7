"""The scan listing read one cell at a time, teacher-forced: does the model open each cell right?

A scan caption (world/scene.py ``scan_listing``) names the nine cells in reading order, each followed by its
objects ("top left, a large purple cross; top, no object; ..."). The word after a cell's name says whether the
model saw something there: "a"/"an" where an object sits, "no" where none does. Fed the reference listing of a
held-out scene, the model's next-token distribution at those nine places separates the captions' two failures:
missed objects (low "a" on object cells) and objects copied into empty places (low "no" on empty cells), without
the knock-on errors of a free-running caption. Greedy captions are what the gate reads; this is the diagnosis
beside it (zoo/TRAINING.md, "Referent attention in the frozen stage").
"""

from __future__ import annotations

import torch

from specula.world import scene
from specula.world.suites import SUITES, _rng

OPENERS = {"object": ("a", "an"), "empty": ("no",)}


@torch.inference_mode()
def scan_cells(model, processor, n: int = 60, offset: int = 0, seed: int = 0) -> dict[str, dict[str, float]]:
    """Over ``n`` held-out caption scenes (indices ``offset``.., the caption suite's own images): per kind of cell
    ("object", "empty"), how many cells, the share where the reference's opening word is the argmax, and its mean
    probability."""
    from specula.zoo.batching import Encoder

    enc = Encoder(processor)
    tok = processor.tokenizer
    if SUITES["caption"].make is not scene.make:
        raise ValueError("the caption suite no longer draws plain scenes: the scan form of its images is unknown")
    stats = {k: [0, 0, 0.0] for k in OPENERS}  # kind -> [cells, argmax right, summed probability]
    for i in range(n):
        s = scene.make(_rng("caption", "eval", offset + i, seed), "caption", "caption", scan=True)  # same image
        e = enc.encode(s)
        logits = model(input_ids=e.input_ids[None].to(model.device),
                       pixel_values=e.pixel_values.to(model.device, model.dtype)).logits[0]  # [L, V]
        words = [w.lower() for w in tok.convert_ids_to_tokens(e.input_ids.tolist())]
        for p in cell_openings(words, e.labels):
            kind = next(k for k, opens in OPENERS.items() if words[p + 1].lstrip("ġ▁ ") in opens)
            prob = logits[p].float().softmax(-1)  # [V]
            want = int(e.input_ids[p + 1])
            st = stats[kind]
            st[0] += 1
            st[1] += int(prob.argmax()) == want
            st[2] += float(prob[want])
    return {k: {"cells": c, "argmax_right": r / max(1, c), "p_mean": p / max(1, c)} for k, (c, r, p) in stats.items()}


def cell_openings(words: list[str], labels: torch.Tensor) -> list[int]:
    """Positions p inside the answer whose token is the comma after a cell's name and whose next token opens the
    cell ("a", "an", "no"): the model's prediction at p is the cell's verdict.

    words  # [L] lower-cased tokens; labels # [L] int64, -100 outside the answer
    """
    opens = {w for ws in OPENERS.values() for w in ws}
    return [p for p in range(len(words) - 1)
            if labels[p + 1] >= 0 and words[p].lstrip("ġ▁ ") == "," and words[p + 1].lstrip("ġ▁ ") in opens]
