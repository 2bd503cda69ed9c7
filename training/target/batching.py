"""Turn world samples into training tensors: token ids with assistant-only labels, pixels, and dense patch targets."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from specula.world.sample import Sample
from specula.world.tokenizer import ASSISTANT, IMAGE, format_dialogue


@dataclass(frozen=True)
class Encoded:
    input_ids: torch.Tensor  # [L] int64
    labels: torch.Tensor  # [L] int64, -100 outside the assistant turn
    pixel_values: torch.Tensor | None  # [n_img, 3, S, S] fp32
    patch_targets: torch.Tensor | None  # [n_img, T_img, K] int64 word token ids, -1 = none
    patch_classes: torch.Tensor | None = None  # [n_img, T_img, 3] int64 (colour, shape, cell) class, -100 = ignore
    patch_codes: torch.Tensor | None = None  # [n_img, T_img, H] fp32 word codes (training/target/word_codes.py), when asked for
    referents: tuple = ()  # training/target/referents.py ReferentTarget per lookup turn, when asked for
    lone_images: torch.Tensor | None = None  # [n_img] bool: images pulled towards their states alone (``sets``)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L]
    pixel_values: torch.Tensor | None  # [N_img, 3, S, S]
    patch_targets: torch.Tensor | None  # [N_img, T_img, K]
    n_samples: int
    patch_classes: torch.Tensor | None = None  # [N_img, T_img, 3]
    patch_codes: torch.Tensor | None = None  # [N_img, T_img, H]
    referents: tuple = ()  # per row: that row's ReferentTargets (empty tuple: none asked for)
    label_weights: torch.Tensor | None = None  # [B, L] fp32 per-label loss weight (training/target/cell_weights.py); None = 1
    lone_images: torch.Tensor | None = None  # [N_img] bool, in pixel_values' order (Encoded.lone_images)


class Encoder:
    """Holds the processor and the word -> token map for dense patch targets."""

    def __init__(self, processor, max_words: int = 5, codes=None, referents: bool = False, sets: bool = False,
                 set_referents: bool = False, set_marks: bool = False, set_hops: str = "deep",
                 set_isolation: bool = False, set_odd: bool = False, set_count: bool = False,
                 chart_referents: bool = False, chart_words: str = ""):
        self.processor = processor
        self.chart_words = chart_words  # "" or a level: chart parts' codes and word targets name what they show (training/target/chart_words.py)
        self.chart_referents = chart_referents  # each chart sample also carries its lookup turns' targets (training/target/chart_referents.py)
        self.set_isolation = set_isolation  # ... and its later images' isolation spans (training/target/set_isolation.py)
        self.set_referents = set_referents  # each image-set sample also carries its addressing targets (training/target/set_referents.py)
        self.set_marks = set_marks  # ... and its object patches' "Image n:" marker targets (set_mark_targets)
        self.set_odd = set_odd  # ... and its "odd one out" answers' odd-image targets (set_odd_targets)
        self.set_count = set_count  # ... and its counting turns' summary and count targets (training/target/set_count.py)
        self.set_hops = set_hops  # the layers of those hops: a key of set_referents.SET_HOPS
        self.sets = sets  # each image of an image-set sample is flagged in ``Encoded.lone_images``
        self.codes = codes  # a WordCodes: each encoded sample also carries its patches' codes
        self.referents = referents  # each encoded scene dialogue also carries its lookup turns' attention targets
        self.tok = processor.tokenizer
        self.assistant_id = self.tok.convert_tokens_to_ids(ASSISTANT)
        self.image_id = self.tok.convert_tokens_to_ids(IMAGE)
        self.eos_id = self.tok.eos_token_id
        self.max_words = max_words
        self._word_ids: dict[str, int] = {}

    def word_id(self, word: str) -> int:
        if word not in self._word_ids:
            ids = self.tok(word, add_special_tokens=False).input_ids
            if len(ids) == 2 and self.tok.convert_ids_to_tokens(ids[0]) == "▁":
                ids = ids[1:]  # punctuation: a lone word marker, then the mark itself (the token used inside text)
            self._word_ids[word] = ids[0] if len(ids) == 1 else -1  # only single-token words are targets
        return self._word_ids[word]

    def encode(self, s: Sample) -> Encoded:
        text = format_dialogue(s.prompt, s.response, s.followups, s.system)
        if s.images:
            out = self.processor(text=[text], images=list(s.images), return_tensors="pt", add_special_tokens=False)
            pixels = out["pixel_values"]
        else:
            out = self.tok([text], return_tensors="pt", add_special_tokens=False)
            pixels = None
        ids = out["input_ids"][0]  # [L]
        labels = assistant_labels(ids, self.assistant_id, self.eos_id)
        targets = classes = codes = None
        if s.images:
            patch_words = s.patch_words  # per image, per patch: the words its code and word targets name
            if self.chart_words:
                from specula.training.target.chart_words import chart_reading_words

                patch_words = tuple(chart_reading_words(s.kind, w, im, self.chart_words)
                                    for w, im in zip(s.patch_words, s.images))
            if self.codes is not None:
                codes = self.codes.images(patch_words)  # [n_img, T, H]
            classes = patch_classes(s.patch_words)
            t = torch.full((len(s.images), len(patch_words[0]), self.max_words), -1, dtype=torch.long)
            for i, per_patch in enumerate(patch_words):
                for j, words in enumerate(per_patch):
                    for k, w in enumerate(words[: self.max_words]):
                        t[i, j, k] = self.word_id(w)
            targets = t
        refs = ()
        if self.referents:
            from specula.training.target.referents import referent_targets

            refs = referent_targets(s, ids, labels, self.image_id, self.word_id)
        if self.chart_referents:
            from specula.training.target.chart_referents import chart_referent_targets

            refs = tuple(refs) + chart_referent_targets(s, ids, labels, self.image_id, self.word_id,
                                                        reading=self.chart_words)
        if self.set_referents or self.set_marks:
            from specula.training.target.set_referents import SET_HOPS, set_mark_targets, set_referent_targets

            hops = SET_HOPS[self.set_hops]
            if self.set_referents:
                refs = tuple(refs) + set_referent_targets(s, ids, labels, self.image_id, self.word_id, hops)
            if self.set_marks:
                refs = tuple(refs) + set_mark_targets(s, ids, self.image_id, self.word_id, hops)
        if self.set_odd:
            from specula.training.target.set_referents import set_odd_targets

            refs = tuple(refs) + set_odd_targets(s, ids, labels, self.image_id)
        if self.set_count:
            from specula.training.target.set_count import set_count_targets

            refs = tuple(refs) + set_count_targets(s, ids, labels, self.image_id, self.word_id)
        if self.set_isolation:
            from specula.training.target.set_isolation import set_isolation_spans

            refs = tuple(refs) + set_isolation_spans(s, ids, self.image_id)
        return Encoded(ids, labels, pixels, targets, classes, codes, refs, self._lone_images(s))

    def _lone_images(self, s: Sample) -> torch.Tensor | None:
        """With ``sets``: one flag per image, set for the images of an image set (``kind`` multi/..., multi_caption,
        multi_dialogue; a clip's frames are read through each other and stay unflagged)."""
        if not (self.sets and s.images):
            return None
        return torch.full((len(s.images),), s.kind.startswith("multi"), dtype=torch.bool)


def assistant_labels(ids: torch.Tensor, assistant_id: int, eos_id: int) -> torch.Tensor:
    """Labels for next-token training: every assistant turn's tokens (through its EOS) keep their id, the rest -100.

    ids # [L] int64
    """
    inside = torch.zeros_like(ids, dtype=torch.bool)  # [L]
    on = False
    for i, t in enumerate(ids.tolist()):
        inside[i] = on
        if t == assistant_id:
            on = True
        elif t == eos_id and on:
            on = False
    return torch.where(inside, ids, torch.full_like(ids, -100))


def collate(items: list[Encoded], pad_id: int) -> Batch:
    L = max(len(e.input_ids) for e in items)
    B = len(items)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, e in enumerate(items):
        n = len(e.input_ids)
        ids[b, :n], labels[b, :n], mask[b, :n] = e.input_ids, e.labels, 1
    pix = [e.pixel_values for e in items if e.pixel_values is not None]
    tgt = [e.patch_targets for e in items if e.patch_targets is not None]
    cls = [e.patch_classes for e in items if e.patch_classes is not None]
    codes = [e.patch_codes for e in items if e.patch_codes is not None]
    lone = None
    if any(e.lone_images is not None for e in items):  # rows with images but no flags (not encoded with sets): False
        lone = torch.cat([e.lone_images if e.lone_images is not None
                          else torch.zeros(len(e.pixel_values), dtype=torch.bool)
                          for e in items if e.pixel_values is not None])  # [N_img]
    return Batch(ids, mask, labels, torch.cat(pix) if pix else None, torch.cat(tgt) if tgt else None, B,
                 torch.cat(cls) if cls else None, torch.cat(codes) if codes else None,
                 tuple(e.referents for e in items) if any(e.referents for e in items) else (), None, lone)


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor on ``device`` (the same batch when they are there already)."""
    device = torch.device(device)
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


_PLACE_WORDS = ("top", "bottom", "left", "right", "center")


def patch_classes(patch_words) -> torch.Tensor:
    """Dense labels for the vision heads per patch: colour index (NONE = background), shape index, and the 3 x 3
    layout cell (an object patch: its object's cell, named by its "where" words; any other patch: the cell it lies
    in).

    A patch covered by something without a colour/shape name (chart text, a sign's word) is ignored (-100) by the
    colour and shape heads.
    """
    from specula.world.vocab import COLOUR_NAMES, POSITIONS, SHAPES

    cells = list(POSITIONS)  # [(row, col)] in class order
    where = {name: k for k, name in enumerate(POSITIONS.values())}
    out = torch.full((len(patch_words), len(patch_words[0]), 3), -100, dtype=torch.long)  # [n_img, T, 3]
    for i, per_patch in enumerate(patch_words):
        side = math.isqrt(len(per_patch))
        for j, words in enumerate(per_patch):
            out[i, j, 2] = cells.index((3 * (j // side) // side, 3 * (j % side) // side))
            if not words:
                out[i, j, :2] = torch.tensor([len(COLOUR_NAMES), len(SHAPES)])
                continue
            for w in words:
                if w in COLOUR_NAMES:
                    out[i, j, 0] = COLOUR_NAMES.index(w)
                if w in SHAPES:
                    out[i, j, 1] = SHAPES.index(w)
            place = " ".join(w for w in words if w in _PLACE_WORDS)
            if place in where and any(w in SHAPES for w in words):  # a scene object, not a sign's or chart's word
                out[i, j, 2] = where[place]
    return out


def token_budget_batches(items: list[Encoded], budget: int) -> list[list[Encoded]]:
    """Group by length so that (rows x longest row) stays under ``budget`` tokens."""
    items = sorted(items, key=lambda e: len(e.input_ids))
    groups, cur = [], []
    for e in items:
        longest = max([len(x.input_ids) for x in cur] + [len(e.input_ids)])
        if cur and longest * (len(cur) + 1) > budget:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    return groups
