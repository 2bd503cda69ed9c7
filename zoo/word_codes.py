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
Fixed codes keep every word equally loud (README, "The embedded target").
"""

from __future__ import annotations

import hashlib

import torch


class WordCodes:
    """Deterministic word -> code map; codes are fp32 unit vectors ``[dim]``, cached per word and per patch."""

    def __init__(self, dim: int, seed: int = 0):
        if dim <= 0:
            raise ValueError(f"code dim must be positive, got {dim}")
        self.dim = dim
        self.seed = seed
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
        """Sum of the words' codes (zero for no word)  # [dim]"""
        v = self._patches.get(words)
        if v is None:
            v = torch.zeros(self.dim)
            for w in words:
                v = v + self.code(w)
            self._patches[words] = v
        return v

    def images(self, patch_words) -> torch.Tensor:
        """Codes of every patch of every image: ``patch_words[i][j]`` is patch j of image i  # [n_img, T, dim]"""
        return torch.stack([torch.stack([self.patch(tuple(w)) for w in per_image]) for per_image in patch_words])
