"""Set referents: teach the LM which image of a set a question or a caption line is about (addressing).

With a set's later images readable at their place (``--set-consistency``, training/target/set_consistency.py), "what
colour is the object in the second image?" still stayed near its blank level: the answer reads the first image's
colour. Picking the image is the same two-hop lookup ``training/target/referents.py`` supervises for objects in one
scene, with the image's number in place of the object's words: at the position that predicts the answer, a head
fetches the question's ordinal ("second"), and a head deeper in the LM uses it to attend to that image's object
patches. For the patch hop to find them, the image tokens must carry their image's number, which the layers below it
have to work out (from an ``Image 2:`` marker before the image, or from where the image sits); so the set's hops can
sit deeper than the scene's (``SET_WORD_LAYER``, ``SET_PATCH_LAYER``), leaving the layers below to do that.

Targets (group ``"set"``, their own loss weight: ``--set-referents W``):
- every "which" turn of an image set ("What colour is the object in the {ordinal} image?", single questions and
  the training dialogues' turns): at the answer's query position, the patch hop on the named image's object
  patches, the word hop on the ordinal;
- every line of a scan caption of a set ("Image 2 has a black star."): at each position from "has" to the token
  that predicts the line's last word, the patch hop on that image's object patches, the word hop on the line's
  number token.
Placed forms (question first, a lead line, a system turn) keep their targets: positions come from the tokens.

The patch hop alone learns to land on objects but not on the named image's (a third of its mass on the named image's
objects and two thirds on the others' after 1,500 samples, with the ordinal hop at 0.99; zoo/TRAINING.md, "Image
sets: which image a question names"): the image tokens do not know their image's number. ``--set-marks W`` (group
``"set_mark"``) takes the number from the prompt: with the processor numbering every set's images
(``--number-images``, targets/image_marks.py), each image follows its ``Image n:`` marker, and at every object patch
of image n head ``SET_MARK_HEAD`` of layer ``SET_MARK_LAYER`` attends to that marker's number token, so the patch
carries the embedding of "2" itself, a key the ordinal "second" can match.

Where the hops sit is ``SET_HOPS[name]`` (``--set-hops``): ``"deep"`` (word hop layer 2, patch hop layer 4, mark hop
layer 1; the layers below left to work the number out) or ``"shallow"`` (word hop layer 0 and patch hop layer 1, head
0: the very heads the scene lookups use to read an object's colour in one image, ``training/target/referents.py``;
mark hop layer 0), so that a set's "which" answer is read by the circuit that already reads colours.

The LM writes a colour word at layer 1 only (head 0 and the MLP after it: the whole margin of a one-image answer), so
the set hop has to be that reader; and in ``"shallow"`` the ordinal hop did not form on head 0 of layer 0, the scene
lookups' word hop, which a set question already uses for its noun (zoo/TRAINING.md, "Image sets: layer 0 reads a
set's images as text"). ``"reader"``, the recipe's, keeps the shallow layers and moves the ordinal hop to head
``READER_WORD_HEAD`` of layer 0: the patch hop (head 0 of layer 1) then reads the ordinal from one head's output and
the image number the mark hop (head 2 of layer 0) wrote on the patches.

``--set-odd W`` (group ``"set_odd"``, ``set_odd_targets``) does the same for "which image is the odd one out?": at the
answer, head ``ODD_HEAD`` of layer ``ODD_LAYER`` on the odd image's object patches, whose number is the answer;
nothing in the question names that image, so the head has to find it by what the other images share. Alone it did
not (on objects, but no more on the odd image's than on the others'), so a head of the layer below
(``ODD_MEAN_HEAD`` of ``ODD_MEAN_LAYER``) is also asked to spread over every image's objects, which puts the set's
common look on the answer position for the odd hop to compare against (zoo/TRAINING.md, "Image sets: counting
images, and the odd one out against the set's look").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specula.world.sample import Sample
from specula.world.vocab import COLOUR_NAMES, ORDINALS
from specula.training.target.referents import PATCH_LAYER, WORD_LAYER, ReferentTarget, answer_spans

SET_WORD_LAYER = 2  # the head that fetches the question's ordinal (or the caption line's number)
SET_PATCH_LAYER = 4  # the head that attends to the named image's object patches
SET_MARK_LAYER, SET_MARK_HEAD = 1, 2  # the head that fetches a patch's ``Image n:`` number
READER_WORD_HEAD = 4  # "reader": the layer-0 head that fetches the ordinal (head 0 is the scene word hop; in the
# shipped target head 4 already puts all its mass on a "which" question's ordinal at the answer)
ODD_LAYER, ODD_HEAD = 2, 0  # the head that finds the odd image of a set (set_odd_targets): one layer above the
# reader, so that the layers below can put the set's common look on the answer position to compare against
ODD_MEAN_LAYER, ODD_MEAN_HEAD = 1, 3  # the head that puts that common look there: spread over every image's objects
MARK_REACH = 4  # the marker's number token lies at most this many tokens before its image's first token


@dataclass(frozen=True)
class SetHops:
    """The decoder layers and heads of the set hops."""

    word_layer: int  # the answer position fetches the question's ordinal (a caption line's number)
    patch_layer: int  # ... and attends to the named image's object patches
    mark_layer: int  # each object patch fetches its ``Image n:`` number
    word_head: int = 0
    patch_head: int = 0
    mark_head: int = SET_MARK_HEAD

    @property
    def layers(self) -> tuple[int, int, int]:
        return self.word_layer, self.patch_layer, self.mark_layer


SET_HOPS = {"deep": SetHops(SET_WORD_LAYER, SET_PATCH_LAYER, SET_MARK_LAYER),
            "shallow": SetHops(WORD_LAYER, PATCH_LAYER, 0),
            "reader": SetHops(WORD_LAYER, PATCH_LAYER, 0, word_head=READER_WORD_HEAD)}


def hops_in_use(hops: SetHops, referents: bool, marks: bool, readout: bool,
                odd: bool = False) -> dict[str, tuple[int, int]]:
    """(layer, head) of each set hop that the switched-on terms train or read, by hop name: ``--set-referents``
    trains the ordinal and patch hops, ``--set-readout`` reads the patch hop's head, ``--set-marks`` trains the mark
    hop, ``--set-odd`` the odd-image heads. A run needs an LM with more layers and heads than any of them."""
    used: dict[str, tuple[int, int]] = {}
    if referents:
        used["ordinal"] = (hops.word_layer, hops.word_head)
    if referents or readout:
        used["patch"] = (hops.patch_layer, hops.patch_head)
    if marks:
        used["mark"] = (hops.mark_layer, hops.mark_head)
    if odd:
        used["odd mean"] = (ODD_MEAN_LAYER, ODD_MEAN_HEAD)
        used["odd"] = (ODD_LAYER, ODD_HEAD)
    return used


_ODD = re.compile(r"\b(different from the others|odd one out)\b")
_WHICH = re.compile(r"\bthe (" + "|".join(ORDINALS) + r") image\b")


def object_patches(patch_words: tuple[tuple[str, ...], ...]) -> list[int]:
    """The patch indices of an image that show an object (their words start with a colour)."""
    return [t for t, w in enumerate(patch_words) if w and w[0] in COLOUR_NAMES]


def set_image_tokens(s: Sample, input_ids: torch.Tensor, image_id: int) -> tuple[int, list[int]] | None:
    """(tokens per image, every image token's position) of an image-set sample (``kind`` multi/...,
    multi_dialogue, multi_caption); None for anything else or when the image tokens do not match its images."""
    if not s.kind.startswith("multi") or len(s.images) < 2 or len(s.patch_words) != len(s.images):
        return None
    n_tok = len(s.patch_words[0])
    image_pos = (input_ids == image_id).nonzero()[:, 0].tolist()
    return (n_tok, image_pos) if len(image_pos) == n_tok * len(s.images) else None


def set_referent_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor, image_id: int,
                         word_id: Callable[[str], int], hops: SetHops = SET_HOPS["deep"]) -> tuple[ReferentTarget, ...]:
    """The addressing targets of an image-set sample (``kind`` multi/..., multi_dialogue, multi_caption); () for
    anything else or when the image tokens do not match the sample's images.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns)
    """
    images = set_image_tokens(s, input_ids, image_id)
    if images is None:
        return ()
    n_tok, image_pos = images

    def patches(n: int) -> tuple[int, ...]:  # image n's object patches, as token positions
        return tuple(image_pos[n * n_tok + t] for t in object_patches(s.patch_words[n]))

    if s.kind == "multi_caption":
        return _caption_lines(input_ids, labels, patches, len(s.images), word_id, hops)
    ids = input_ids.tolist()
    starts, ends = answer_spans(labels)
    questions = [s.prompt] + [u for u, _ in s.followups]
    out = []
    for i, (q, a) in enumerate(zip(questions, starts)):
        m = _WHICH.search(q.lower())
        if m is None:
            continue
        n = ORDINALS.index(m.group(1))
        prev = ends[i - 1] if i > 0 and i - 1 < len(ends) else 0  # the question's turn starts after the last answer
        ordinal = [j for j in range(prev, a) if ids[j] == word_id(m.group(1))]
        pos = patches(n) if n < len(s.images) else ()
        if pos and ordinal:
            out.append(ReferentTarget(a - 1, pos, (ordinal[-1],), hops.patch_layer, hops.word_layer, "set",
                                      head=hops.patch_head, word_head=hops.word_head))
    return tuple(out)


def set_odd_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor,
                    image_id: int) -> tuple[ReferentTarget, ...]:
    """At the answer of every "which image is different / the odd one out?" turn of an image set (single questions
    and the training dialogues' turns), two targets of group ``"set_odd"`` (no word hops); () for anything else or
    when the image tokens do not match the images:
    - the mean hop: head ``ODD_MEAN_HEAD`` of layer ``ODD_MEAN_LAYER`` spread evenly over the object patches of every
      image (``spread``), which puts the set's common look (the majority's colour and shape) on the answer position;
    - the odd hop: head ``ODD_HEAD`` of layer ``ODD_LAYER`` on the odd image's object patches.

    The answer is that image's ordinal, and its patches carry their image's number (``--set-marks``), so a head that
    lands there reads the answer off them, as the "which" reader does; unlike "which", nothing in the question names
    the image: the odd hop's query has to hold what the images share (the mean hop's output) and land on the patches
    least like it. The odd hop trained alone landed on objects (0.98 of its mass) but on the odd image's no more than
    on the others'.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns)
    """
    images = set_image_tokens(s, input_ids, image_id)
    if images is None:
        return ()
    n_tok, image_pos = images
    starts, _ = answer_spans(labels)
    turns = [(s.prompt, s.response)] + list(s.followups)
    objects = [tuple(image_pos[n * n_tok + t] for t in object_patches(words)) for n, words in enumerate(s.patch_words)]
    out = []
    for (q, a), start in zip(turns, starts):
        word = a.strip(" .").lower()
        n = ORDINALS.index(word) if word in ORDINALS else len(s.images)
        if _ODD.search(q.lower()) is None or n >= len(s.images) or not objects[n]:
            continue
        out.append(ReferentTarget(start - 1, sum(objects, ()), (), patch_layer=ODD_MEAN_LAYER, group="set_odd",
                                  head=ODD_MEAN_HEAD, spread=True))
        out.append(ReferentTarget(start - 1, objects[n], (), patch_layer=ODD_LAYER, group="set_odd", head=ODD_HEAD))
    return tuple(out)


def _caption_lines(input_ids: torch.Tensor, labels: torch.Tensor, patches: Callable[[int], tuple[int, ...]], k: int,
                   word_id: Callable[[str], int], hops: SetHops) -> tuple[ReferentTarget, ...]:
    """A scan caption's lines ("Image n has ... ."): each position from "has" to the one predicting the line's last
    word attends to image n's object patches (patch hop) and to the line's number token (word hop)."""
    ids, lab = input_ids.tolist(), labels.tolist()
    image, has, dot = word_id("Image"), word_id("has"), word_id(".")
    numbers = {word_id(str(n + 1)): n for n in range(k)}
    out = []
    for j in range(len(ids) - 2):
        if lab[j] == -100 or ids[j] != image or ids[j + 1] not in numbers or ids[j + 2] != has:
            continue
        end = next((e for e in range(j + 3, len(ids)) if ids[e] == dot or lab[e] == -100), None)
        pos = patches(numbers[ids[j + 1]])
        if end is None or not pos:
            continue
        out.extend(ReferentTarget(q, pos, (j + 1,), hops.patch_layer, hops.word_layer, "set", head=hops.patch_head,
                                  word_head=hops.word_head) for q in range(j + 2, end - 1))
    return tuple(out)


def set_mark_targets(s: Sample, input_ids: torch.Tensor, image_id: int, word_id: Callable[[str], int],
                     hops: SetHops = SET_HOPS["deep"]) -> tuple[ReferentTarget, ...]:
    """At every object patch of image n of an image-set sample, the number token of the ``Image n:`` marker just
    before the image (within ``MARK_REACH`` tokens); images without their marker get none; () for anything else.

    input_ids # [L] int64
    """
    images = set_image_tokens(s, input_ids, image_id)
    if images is None:
        return ()
    n_tok, image_pos = images
    ids = input_ids.tolist()
    out = []
    for n, words in enumerate(s.patch_words):
        first = image_pos[n * n_tok]
        number, mark = word_id(str(n + 1)), word_id("Image")
        at = [j for j in range(max(1, first - MARK_REACH), first) if ids[j] == number and ids[j - 1] == mark]
        if not at:
            continue
        out.extend(ReferentTarget(image_pos[n * n_tok + t], (at[-1],), (), patch_layer=hops.mark_layer,
                                  group="set_mark", head=hops.mark_head) for t in object_patches(words))
    return tuple(out)
