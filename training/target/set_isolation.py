"""Set isolation: a set's image tokens do not read the other images.

Why a set's later images are read wrong even once the named image is found (zoo/TRAINING.md, "Image sets: the images
blend into each other at layer 0"): at the object patches of a set's second and third images, four of the six
layer-0 heads put 0.47-0.70 of their mass on the *earlier images'* tokens (0.22-0.28 on their own image's). In
training every one-image prompt, a patch's neighbours in attention are its own image's, so mixing in other object
patches costs nothing; in a set it blends the objects of different images into each other. A linear probe of the
named image's object patches reads their colour 1.00 from the visual tokens themselves, 0.40 after layer 0 and 0.31
after layer 3, against 0.94 for a one-image lookup's referent after layer 0 and after layer 3.

``--set-isolation W`` forbids the blend directly: for every object patch of a set's image n (n >= 2), in every layer
and head, the attention mass on the tokens of the set's earlier images is penalised, ``-log(1 - mass)`` averaged
over each image's patches and heads, then over the images and layers (group ``"set_isolation"``). An image's
patches may still read the text (its ``Image n:`` marker) and their own image; the answer positions read across
images as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula.world.sample import Sample
from specula.training.target.set_referents import object_patches, set_image_tokens


@dataclass(frozen=True)
class IsolationSpan:
    """One later image of a set: its object patches and the tokens of the images before it (positions)."""

    patches: tuple[int, ...]  # image n's object patches
    others: tuple[int, ...]  # every token of images 1..n-1
    group: str = "set_isolation"  # rides in ``Encoded.referents`` beside the ReferentTargets (their loss skips it)


def set_isolation_spans(s: Sample, input_ids: torch.Tensor, image_id: int) -> tuple[IsolationSpan, ...]:
    """One span per image after the first of an image-set sample with object patches; () for anything else.

    input_ids # [L] int64
    """
    images = set_image_tokens(s, input_ids, image_id)
    if images is None:
        return ()
    n_tok, image_pos = images
    out = []
    for n in range(1, len(s.images)):
        own = [image_pos[n * n_tok + t] for t in object_patches(s.patch_words[n])]
        if own:
            out.append(IsolationSpan(tuple(own), tuple(image_pos[:n * n_tok])))
    return tuple(out)


def set_isolation_loss(attentions: Sequence[torch.Tensor], targets: Sequence[Sequence]) -> torch.Tensor | None:
    """-log(1 - mass on the earlier images), averaged over each (span, layer)'s heads and patches, then over the
    (span, layer)s, so that a small object weighs as much as a large one; None when the batch has no span.

    attentions: per decoder layer [B, heads, L, L] (softmax weights); targets: per batch row (``Encoded.referents``).
    """
    terms = []
    for b, row in enumerate(targets):
        for t in row:
            if t.group != "set_isolation":
                continue
            q = list(t.patches)
            for a in attentions:
                off = torch.ones(a.shape[-1], dtype=torch.bool, device=a.device)  # [L] keys outside the earlier images
                off[list(t.others)] = False
                # 1 - mass summed directly: near saturation 1 - mass rounds to 0 in fp32 and a clamp would stop the
                # gradient, as an epsilon inside the log did for the set hops (training/target/referents.py LOG_EPS)
                rest = (a[b][:, q].float() * off).sum(-1)  # [heads, P]
                terms.append(-torch.log(rest.clamp_min(1e-30)).mean())
    if not terms:
        return None
    return torch.stack(terms).mean()
