"""Set counts: teach the LM to count the images of a set that show a shape ("How many images show a star?").

Counting images is not a lookup: the answer depends on every image at once, and an image shows its object on a
varying number of patches, so a head spread over the matching patches would count patches, not images. The circuit
these targets ask for gives every image one token to be counted by:
- the summary hop: at each image's summary token (the first token after its last image token: the next image's
  ``Image n:`` marker, or the question after the last image), head ``SUMMARY_HEAD`` of layer ``SUMMARY_LAYER`` on
  that image's object patches, so the token carries the shapes its image shows;
- the count hop: at the answer of every counting turn, head ``COUNT_HEAD`` of layer ``COUNT_LAYER`` spread evenly
  (``spread``) over the sequence's first token and the summary tokens of the images that show the asked shape, with
  the word hop (head 0 of layer 0, the scene lookups' word hop) on the shape word the query matches them by. The
  share left on the first token is 1 / (m + 1) for m such images, which the layers above turn into the number
  (m = 0: all of it).

Each count target names the number it answers (``says``: ``--set-count-number-readout W`` reads the count head out
alone as that number), and each summary target the shape words its image shows: ``--set-count-readout W``
reads the summary head's own output out through the LM head and asks it to say them (training/target/set_readout.py
``summary_readout_loss``), so that the summary token's key carries the shape as the word the count hop's query
fetched. Without the readout the count hop landed on the first token and the summaries but did not tell matching
summaries from the others (zoo/TRAINING.md, "Image sets: counting images, and the odd one out against the set's
look").

Group ``"set_count"``, its own loss weight (``--set-count W``); single questions, dialogue turns and placed forms
(positions come from the tokens). Images back to back (``<image><image>``) have no token between them to summarise
on, so a set gets its targets only with its ``Image n:`` markers (``--number-images``); nor has the last image of
a set that ends the user's turn (the question first), whose next token is the answer's query itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from specula.world.sample import Sample
from specula.world.vocab import NUMBER_WORDS, SHAPES
from specula.training.target.referents import WORD_LAYER, ReferentTarget, answer_spans
from specula.training.target.set_referents import object_patches, set_image_tokens

SUMMARY_LAYER, SUMMARY_HEAD = 0, 3  # the head that reads an image's objects onto its summary token
COUNT_LAYER, COUNT_HEAD = 1, 2  # the head that spreads over the first token and the matching images' summaries
COUNT_WORD_HEAD = 0  # the word hop (layer WORD_LAYER): the scene lookups' head, which fetches a question's noun

_COUNT = re.compile(r"\bhow many images (?:show|is there) an? (" + "|".join(SHAPES) + r")\b")


def set_count_hops() -> dict[str, tuple[int, int]]:
    """(layer, head) of each count hop, by hop name (for the depth and head refusal of a run)."""
    return {"count summary": (SUMMARY_LAYER, SUMMARY_HEAD), "count": (COUNT_LAYER, COUNT_HEAD),
            "count word": (WORD_LAYER, COUNT_WORD_HEAD)}


def set_count_targets(s: Sample, input_ids: torch.Tensor, labels: torch.Tensor, image_id: int,
                      word_id: Callable[[str], int]) -> tuple[ReferentTarget, ...]:
    """The summary hops of every image of a set with at least one counting turn, and each counting turn's count
    hop; () for anything else or when the image tokens do not match the sample's images.

    input_ids, labels # [L] int64 (labels -100 outside the assistant turns)
    """
    turns = [(s.prompt, s.response)] + list(s.followups)
    asked = [_COUNT.search(q.lower()) for q, _ in turns]
    images = set_image_tokens(s, input_ids, image_id) if any(asked) else None
    if images is None:
        return ()
    n_tok, image_pos = images
    ids = input_ids.tolist()
    summary = [image_pos[(n + 1) * n_tok - 1] + 1 for n in range(len(s.images))]  # the token after each image
    starts, ends = answer_spans(labels)
    if not starts or summary[-1] >= starts[0] - 1 or any(ids[j] == image_id for j in summary):
        return ()  # images back to back (no ``Image n:`` markers) or the set last in the turn: no token of their own
    out = []
    for n, words in enumerate(s.patch_words):
        obj = object_patches(words)
        pos = tuple(image_pos[n * n_tok + t] for t in obj)
        if pos:
            says = tuple(sorted({word_id(words[t][1]) for t in obj} - {-1}))  # the shapes the image shows
            out.append(ReferentTarget(summary[n], pos, (), patch_layer=SUMMARY_LAYER, group="set_count",
                                      head=SUMMARY_HEAD, says=says))
    for i, (m, start) in enumerate(zip(asked, starts)):
        if m is None:
            continue
        shape = m.group(1)
        shown = [n for n, words in enumerate(s.patch_words) if any(w and w[1] == shape for w in words)]
        prev = ends[i - 1] if i > 0 and i - 1 < len(ends) else 0  # the question's turn starts after the last answer
        word = [j for j in range(prev, start) if ids[j] == word_id(shape)]
        number = word_id(NUMBER_WORDS[len(shown)]) if len(shown) < len(NUMBER_WORDS) else -1
        out.append(ReferentTarget(start - 1, (0,) + tuple(summary[n] for n in shown), tuple(word[-1:]),
                                  patch_layer=COUNT_LAYER, word_layer=WORD_LAYER, group="set_count", head=COUNT_HEAD,
                                  spread=True, word_head=COUNT_WORD_HEAD, says=(number,) if number >= 0 else ()))
    return tuple(out)
