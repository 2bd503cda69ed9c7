"""Word codes: fixed stand-ins for the target's visual tokens while its LM learns to read them.

Every world word ("red", "star", "large", "left", a sign's text, ...) gets a fixed random unit vector of the LM's
width, drawn from a seed and the word itself. A patch's code is the sum of the codes of the words its object
answers to (``Sample.patch_words``); a background patch's code is zero. Training the LM with these codes in
place of the image tokens teaches it to look things up in the image positions before any tower exists; the tower
and projector then learn to produce the codes (a regression), and the joint stage starts from a model that
already reads its visual tokens.

Why fixed codes and not the LM's own word embeddings: with tied embeddings the LM's shape words collapse towards
one direction while shape cannot yet be read (cosine 0.84 between shape words in the shipped target), so a sum of
embeddings carries colour loudly and shape in a faint residual, and the LM never learns to read shape from it.
Fixed codes keep every word equally loud (zoo/TRAINING.md).

Background patches: zero. Zero is a degenerate input for an LM whose layers start with RMSNorm: the norm blows any
small vector up to full size, so the tower's small errors on background patches (norm ~0.015) become full-size random
tokens. An LM trained on exact codes with a zero background answered 0.78 with codes and 0.47 when only its
background patches got random vectors of norm 0.015 (0.33 at norm 0.1, the blank level; zoo/TRAINING.md, "Background
patches"). The projector fit's gate (training/target/projector_fit.py) makes the tower's background exact zeros.
"""

from __future__ import annotations

import hashlib

import torch


PLACE_WORDS = ("top", "bottom", "left", "right", "center")  # an object's place words: its cell's name, split


def cell_word(words: tuple[str, ...]) -> str | None:
    """The reserved word of the 3 x 3 cell a patch's words place it in ("<cell bottom left>"), or None where they
    name no cell. An object patch's words end with its cell's name split into words (world/scene.py
    ``render_scene``), so "bottom left" and "bottom" share code(bottom) in the summed code; the cell word is one
    code per cell, shared with no other."""
    from specula.world.vocab import POSITIONS

    name = " ".join(w for w in words if w in PLACE_WORDS)
    return f"<cell {name}>" if name in POSITIONS.values() else None


class WordCodes:
    """Deterministic word -> code map; codes are fp32 unit vectors ``[dim]``, cached per word and per patch."""

    def __init__(self, dim: int, seed: int = 0, cell_codes: float = 0.0):
        if dim <= 0:
            raise ValueError(f"code dim must be positive, got {dim}")
        self.dim = dim
        self.seed = seed
        self.cell_codes = cell_codes  # > 0: an object patch's code also holds cell_codes * code(its cell_word)
        self._words: dict[str, torch.Tensor] = {}
        self._patches: dict[tuple[str, ...], torch.Tensor] = {}

    def code(self, word: str) -> torch.Tensor:
        """The unit code of one word  # [dim]"""
        v = self._words.get(word)
        if v is None:
            digest = hashlib.sha256(f"specula-word-code/{self.seed}/{word}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            v = torch.randn(self.dim, generator=g)
            v = v / v.norm()
            self._words[word] = v
        return v

    def patch(self, words: tuple[str, ...]) -> torch.Tensor:
        """Sum of the words' codes; a background patch (no word) is zero  # [dim]"""
        v = self._patches.get(words)
        if v is None:
            v = torch.zeros(self.dim)
            for w in words:
                v = v + self.code(w)
            cell = cell_word(words) if self.cell_codes > 0 else None
            if cell is not None:
                v = v + self.cell_codes * self.code(cell)
            self._patches[words] = v
        return v

    def images(self, patch_words) -> torch.Tensor:
        """Codes of every patch of every image: ``patch_words[i][j]`` is patch j of image i  # [n_img, T, dim]"""
        return torch.stack([torch.stack([self.patch(tuple(w)) for w in per_image]) for per_image in patch_words])

    def blank(self, n_img: int, tokens: int) -> torch.Tensor:
        """The codes of blank images: every patch background  # [n_img, T, dim]"""
        return self.patch(()).expand(n_img, tokens, self.dim).clone()
