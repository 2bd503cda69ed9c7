"""Set consistency: each image of an image set pulled towards the states it has alone at the start of a prompt.

The target reads a set's first image and hardly the others: an image's tokens attend to everything before them, so
the second image of a set is, from layer 1 on, something else than the same image alone (zoo/TRAINING.md, "Image
sets: the LM reads the first image of a set"). ``set_consistency_loss`` (``--set-consistency``) runs every such image
alone after ``<s><|user|>`` and pulls its states there ("Image sets: each image read as if alone").
"""

from __future__ import annotations

import torch


def image_places(model, batch, n_tok: int, opening: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each image's tokens sit (row-major, as the features come) and whether the image opens its prompt (its
    first token right after ``opening``, ``<s><|user|>``): pos # [N_img, T, (row, position)], opens # [N_img] bool."""
    k = len(opening)
    pos = (batch.input_ids == model.config.image_token_id).nonzero().view(-1, n_tok, 2)  # [N_img, T, 2]
    first = pos[:, 0]  # [N_img, 2] each image's first token
    opens = (first[:, 1] == k) & (batch.input_ids[first[:, 0], :k] == opening.to(first.device)).all(-1)
    return pos, opens


def lone_states(model, img: torch.Tensor, opening: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every layer's states of each image run alone after ``opening`` (``<s><|user|><image>``: how an image-first
    prompt begins, so by causality the states any image-first prompt gives that image), without gradient.

    img # [n, T, H] projected image features -> each # [n, k + T, H]
    """
    with torch.no_grad():
        head = model.get_input_embeddings()(opening.to(img.device))  # [k, H]
        emb = torch.cat([head.expand(len(img), *head.shape), img.to(head.dtype)], 1)  # [n, k + T, H]
        return model.model.language_model(inputs_embeds=emb, output_hidden_states=True).hidden_states


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    """Each vector scaled to unit RMS (what a layer's input norm reads, up to its gain; layer 1 writes norms of
    ~1,000, so raw distances hide the direction). x # [..., H]"""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def set_consistency_loss(model, batch, img: torch.Tensor, states: tuple[torch.Tensor, ...],
                         opening: torch.Tensor, layers: int = 0) -> torch.Tensor:
    """How far the images of an image set lie, layer by layer, from their states alone at the start of a prompt.

    Every image flagged in ``batch.lone_images`` (the images of set samples; clips are left out, their later frames
    are read through the earlier ones) that does not already open its prompt is run alone (``lone_states``) and its
    states are pulled there: unit-RMS states, squared distance averaged over the hidden size and the layers, then
    over the object patches and over the background patches apart (a background patch enters as a zero vector; 94%
    of a one-object image's patches are background, and the object's few are what a question reads), the two
    averages averaged. 0 when no such image is in the batch.

    ``layers`` = N > 0 pulls only the outputs of the first N decoder layers (``--set-consistency-layers``): layer 0
    reads a set's images, the first included, as if they were not images (its heads attend to the ``Image n:`` text
    instead of their own image; zoo/TRAINING.md, "Image sets: layer 0 reads a set's images as text"), while the layers
    above must add the image's number (``--set-marks``), which its states alone cannot have.
    """
    if batch.lone_images is None:
        return img.new_zeros(())
    k = len(opening)
    pos, opens = image_places(model, batch, img.shape[1], opening)
    sel = batch.lone_images.to(opens.device) & ~opens  # [N_img]
    if not bool(sel.any()):
        return img.new_zeros(())
    ref = lone_states(model, img[sel], opening)
    at = pos[sel]  # [n, T, 2]
    obj = img[sel].abs().amax(-1) > 0  # [n, T] patches with features (background patches enter as zero vectors)
    depth = len(states) - 1 if layers <= 0 else min(layers, len(states) - 1)
    per_tok = 0.0
    for s_h, r_h in zip(states[1:depth + 1], ref[1:depth + 1]):
        s = unit_rms(s_h[at[..., 0], at[..., 1]])  # [n, T, H]
        per_tok = per_tok + (s - unit_rms(r_h[:, k:])).pow(2).mean(-1)  # [n, T]
    per_tok = per_tok / depth
    parts = [per_tok[m].mean() for m in (obj, ~obj) if bool(m.any())]
    return sum(parts) / len(parts)
