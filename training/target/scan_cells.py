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
from specula.training.target.cell_weights import EMPTY_OPENERS, OBJECT_OPENERS, cell_openings, opener_ids

SLOTS = ("size", "colour", "shape")  # the words after an object cell's opener: "a large purple cross"


@torch.inference_mode()
def scan_cells(model, processor, n: int = 60, offset: int = 0, seed: int = 0) -> dict[str, dict[str, float]]:
    """Over ``n`` held-out caption scenes (indices ``offset``.., the caption suite's own images): per kind of cell
    ("object", "empty"), how many cells, the share where the reference's opening word is the argmax, and its mean
    probability; the same for the first object's "size", "colour" and "shape" word in each object cell."""
    from specula.training.target.batching import Encoder

    if SUITES["caption"].make is not scene.make:
        raise ValueError("the caption suite no longer draws plain scenes: the scan form of its images is unknown")
    enc = Encoder(processor)
    comma, kinds = cell_openers(processor.tokenizer)
    stats = {k: [0, 0, 0.0] for k in (*set(kinds.values()), *SLOTS)}  # kind -> [cells, argmax right, summed probability]
    for i in range(n):
        s = scene.make(_rng("caption", "eval", offset + i, seed), "caption", "caption", scan=True)  # same image
        e = enc.encode(s)
        logits = model(input_ids=e.input_ids[None].to(model.device),
                       pixel_values=e.pixel_values.to(model.device, model.dtype)).logits[0]  # [L, V]
        ids = e.input_ids  # [L]
        at = cell_openings(ids, e.labels, comma, tuple(kinds))  # [L-1]
        for p in at.nonzero()[:, 0].tolist():  # the prediction at the comma is the cell's verdict
            kind = kinds[int(ids[p + 1])]
            read = [(kind, p)] + ([(slot, p + 1 + j) for j, slot in enumerate(SLOTS)] if kind == "object" else [])
            for k, q in read:  # the prediction at q is of the word at q + 1
                want = int(ids[q + 1])
                prob = logits[q].float().softmax(-1)  # [V]
                st = stats[k]
                st[0] += 1
                st[1] += int(prob.argmax()) == want
                st[2] += float(prob[want])
    return {k: {"cells": c, "argmax_right": r / max(1, c), "p_mean": p / max(1, c)} for k, (c, r, p) in stats.items()}


def cell_openers(tokenizer) -> tuple[int, dict[int, str]]:
    """(the comma after a cell's name, {token id of an opening word: "object" or "empty"})."""
    comma, objects = opener_ids(tokenizer, OBJECT_OPENERS)
    comma_empty, empties = opener_ids(tokenizer, EMPTY_OPENERS)
    if comma != comma_empty:
        raise ValueError("the tokenizer spells a cell's comma differently before 'a' and 'no'")
    return comma, {**{t: "object" for t in objects}, **{t: "empty" for t in empties}}
