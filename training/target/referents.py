"""Referent attention: teach the LM *which* object a question is about (the selection step of a lookup).

With perfect visual tokens (word codes) a small LM answers lookups on one-object images and fails on crowded
ones: nearly every wrong answer is another object's attribute (``python -m research probe``: ``lookup_errors``). Picking
the object is a two-hop circuit: at the position that predicts the answer, one head fetches the question's
referent words ("square", "red"), and a head in the next layer uses them to attend to that object's patches and
copy its attribute. Learnt from the answer loss alone it stays near uniform for a long time.

So training can supervise it directly: for every lookup turn (colour, shape, size, where) of a scene dialogue whose
referent is one object, ``referent_attention_loss`` asks head 0 of decoder layer ``WORD_LAYER`` at the answer's
query position to put its mass on the question's referent words, and head 0 of layer ``PATCH_LAYER`` to put its
mass on the referent's image tokens (-log of the mass, averaged). In a 2-layer d256 LM on word codes (12-turn
dialogues, 614 steps of 4) this took colour and shape questions from 0.22 / 0.43 to 0.89 / 0.93
(``runs/exp/oracle_lm.py``, ``ATTN=1 ATTN1=1``). The targets come from the question text and the image's patch
words, so they need nothing the world does not already say.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specula.world.sample import Sample
from specula.world.vocab import COLOUR_NAMES, SHAPES

WORD_LAYER = 0  # the head that fetches the question's referent words
PATCH_LAYER = 1  # the head that attends to the referent's patches
HEAD = 0
_NOT_LOOKUP = ("how many", "is there", "can you see", "does the picture", "left of", "above", "higher", "count")


@dataclass(frozen=True)
class ReferentTarget:
    """One lookup turn: positions in the token sequence."""

    query: int  # the position whose logits predict the answer's first token
    patches: tuple[int, ...]  # the referent object's image tokens
    words: tuple[int, ...]  # the question's referent words (shape and/or colour)
    patch_layer: int = PATCH_LAYER  # the decoder layer whose head ``head`` makes the patch hop
    word_layer: int = WORD_LAYER  # ... and the word hop
    group: str = "scene"  # the loss the target feeds: "scene" (referent_attention), "set" (set_referents), ...
    head: int = HEAD  # the head of the patch hop (and of the word hop unless ``word_head`` is set)
    spread: bool = False  # the patch hop's mass spread evenly over ``patches`` (-mean log of each) rather than summed
    word_head: int | None = None  # the word hop's head when it is not ``head`` (set_referents.SET_HOPS["reader"])
    says: tuple[int, ...] = ()  # token ids the patch hop's head, read out alone, should say (training/target/set_readout.py)


def _words(question: str) -> list[str]:
    return [w.strip("?.,!;:") for w in question.lower().split()]


def referent_patches(question: str, patch_words: Sequence[tuple[str, ...]]) -> list[int] | None:
    """Patch indices of the one object a lookup question names (by shape, colour or both); None when the question
    is not a lookup (counting, existence, relations) or does not single out one object."""
    q = question.lower()
    if any(k in q for k in _NOT_LOOKUP):
        return None
    words = _words(question)
    shapes = [w for w in words if w in SHAPES]
    colours = [w for w in words if w in COLOUR_NAMES]
    if not shapes and not colours:
        return None
    objects = {w[:2] for w in patch_words if w}
    match = [o for o in objects if (not shapes or o[1] == shapes[0]) and (not colours or o[0] == colours[0])]
    if len(match) != 1:
        return None
    return [t for t, w in enumerate(patch_words) if w and w[:2] == match[0]]


def referent_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor, image_id: int,
                     word_id: Callable[[str], int]) -> tuple[ReferentTarget, ...]:
    """The lookup turns of a one-image scene dialogue (``vqa`` kinds), in order; () for anything else.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns); ``word_id(w)`` a word's single token
    id or -1.
    """
    if not s.kind.startswith("vqa") or len(s.images) != 1 or not s.patch_words:
        return ()
    questions = [s.prompt.replace("<image>", "")] + [u for u, _ in s.followups]
    starts, ends = answer_spans(labels)
    image_pos = (input_ids == image_id).nonzero()[:, 0].tolist()
    if len(image_pos) != len(s.patch_words[0]):
        return ()
    ids = input_ids.tolist()
    out = []
    for i, (q, a) in enumerate(zip(questions, starts)):
        prev = ends[i - 1] if i > 0 and i - 1 < len(ends) else 0  # the question's turn starts after the last answer
        patches = referent_patches(q, s.patch_words[0])
        if patches:
            want = {word_id(w) for w in _words(q) if w in SHAPES or w in COLOUR_NAMES} - {-1}
            words = tuple(j for j in range(prev, a) if ids[j] in want)
            out.append(ReferentTarget(a - 1, tuple(image_pos[t] for t in patches), words))
    return tuple(out)


def answer_spans(labels: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each answer's first token and the position after each answer (labels # [L], -100 outside the answers)."""
    lab = labels.tolist()
    starts = [j for j in range(1, len(lab)) if lab[j] != -100 and lab[j - 1] == -100]
    ends = [j for j in range(1, len(lab)) if lab[j] == -100 and lab[j - 1] != -100]
    return starts, ends


@contextlib.contextmanager
def eager_attention(lm, on: bool = True):
    """Inside the block the LM runs eager attention (the only kind that returns its weights)."""
    if not on:
        yield
        return
    before = lm.config._attn_implementation
    lm.config._attn_implementation = "eager"
    try:
        yield
    finally:
        lm.config._attn_implementation = before


# The epsilon inside each group's -log(mass + eps). One inside the log flattens the loss wherever a saturated head
# puts less than ~eps on the targets (the gradient on the targets' scores is mass / (mass + eps) instead of 1), so a
# hop onto a head that already attends elsewhere with all its mass never forms: the layer-0 ordinal hops of the
# image-set lanes stuck at 0.00 for it (zoo/TRAINING.md, "Image sets: the reader as the set hop, and a loss that could
# not move a saturated head"). The set groups take the exact log, floored only where fp32 runs out; "scene" keeps the
# 1e-6 the recipe's stages ran with (training/recipe.py), so that ``specula zoo build`` still retraces the shipped
# target.
LOG_EPS = {"scene": 1e-6}


def _log(mass: torch.Tensor, eps: float) -> torch.Tensor:
    return (mass + eps).log() if eps else mass.clamp_min(1e-30).log()


def referent_attention_loss(attentions: Sequence[torch.Tensor], targets: Sequence[Sequence[ReferentTarget]],
                            group: str = "scene") -> torch.Tensor | None:
    """-log attention mass on the targets of ``group``, averaged over every (turn, hop); None when the batch has
    none. A ``spread`` patch hop counts -mean log of each target position's weight instead (least when the mass is
    shared evenly among them).

    attentions: per decoder layer [B, heads, L, L] (softmax weights); targets: per batch row.
    """
    terms, eps = [], LOG_EPS.get(group, 0.0)
    for b, row in enumerate(targets):
        for t in row:
            if t.group != group:
                continue
            if t.patches and len(attentions) > t.patch_layer:
                w = attentions[t.patch_layer][b, t.head, t.query, list(t.patches)].float()  # [n]
                terms.append(-_log(w, eps).mean() if t.spread else -_log(w.sum(), eps))
            if t.words and len(attentions) > t.word_layer:
                head = t.head if t.word_head is None else t.word_head
                terms.append(-_log(attentions[t.word_layer][b, head, t.query, list(t.words)].float().sum(), eps))
    if not terms:
        return None
    return torch.stack(terms).mean()
