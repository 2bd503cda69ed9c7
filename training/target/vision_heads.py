"""Training-only dense heads on the vision tower: per-patch colour and shape classes, and optionally the 3 x 3 cell.

They give the tower a direct, cheap signal for what each patch shows (the LM's losses reach it only through the
projector). They are not part of the shipped model. ``vision_stage`` trains tower + projector with these heads
and the projector-side patch-word loss alone, without the LM's layers: many images per second, so shapes are
learnt in minutes instead of hours of joint training.
"""

from __future__ import annotations

import random
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from specula.world.vocab import COLOUR_NAMES, POSITIONS, SHAPES


def patch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy against the patch's words.

    logits  # [N, T, V] fp32
    targets # [N, T, K] int64 token ids, -1 = no word; each present word gets an equal share of the target mass
    """
    valid = targets >= 0  # [N, T, K]
    n_words = valid.sum(-1)  # [N, T]
    keep = n_words > 0
    if not keep.any():
        return logits.new_zeros(())
    logp = F.log_softmax(logits[keep], dim=-1)  # [M, V]
    t, v = targets[keep], valid[keep]  # [M, K]
    picked = logp.gather(-1, t.clamp(min=0)) * v  # [M, K]
    return -(picked.sum(-1) / v.sum(-1)).mean()


class VisionHeads(nn.Module):
    """``place_weight`` > 0 adds a head that reads each patch's 3 x 3 layout cell (an object patch: its object's
    cell, the one "where" answers name). The colour and shape heads can be served by a bag of patches; this one
    cannot, so the tower must carry position to its last layer, where the projector reads it
    (zoo/TRAINING.md, "The tower cannot see where")."""

    def __init__(self, dim: int, place_weight: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # the tower's last hidden state is not normalised (LLaVA reads it raw)
        self.colour = nn.Linear(dim, len(COLOUR_NAMES) + 1)  # + background
        self.shape = nn.Linear(dim, len(SHAPES) + 1)
        self.place_weight = place_weight
        self.place = nn.Linear(dim, len(POSITIONS)) if place_weight > 0 else None

    def loss(self, feats: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """feats [N, T, D] pre-projector tower features; classes [N, T, 3] (colour, shape, cell; -100 = ignore)."""
        x = self.norm(feats)
        lc = F.cross_entropy(self.colour(x).flatten(0, 1).float(), classes[..., 0].flatten(), ignore_index=-100)
        ls = F.cross_entropy(self.shape(x).flatten(0, 1).float(), classes[..., 1].flatten(), ignore_index=-100)
        if self.place is None:
            return lc + ls
        lp = F.cross_entropy(self.place(x).flatten(0, 1).float(), classes[..., 2].flatten(), ignore_index=-100)
        return lc + ls + self.place_weight * lp


def tower_features(model, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-layer tower features [N, T, D_vis] for the dense heads, projected [N, T, H]) with the projector fed
    exactly as LLaVA feeds it: the hidden states at ``vision_feature_layer`` (an index or a list, concatenated),
    CLS dropped (strategy "default")."""
    out = model.model.vision_tower(pixel_values, output_hidden_states=True)
    return out.hidden_states[-1][:, 1:], model.model.multi_modal_projector(projector_input(model, out.hidden_states))


def projector_input(model, hidden_states) -> torch.Tensor:
    """The tower's hidden states at ``vision_feature_layer`` (an index or a list, concatenated), CLS dropped
    # [N, T, D_vis * n_layers]"""
    layers = model.config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    return torch.cat([hidden_states[i][:, 1:] for i in layers], dim=-1)


def vision_stage(model, heads: VisionHeads, encoder, n_images: int, seed: int, lr: float = 1e-3,
                 batch_images: int = 32, aux_weight: float = 0.5, log=print, start: int = 0,
                 checkpoint: Callable[[int, dict], None] | None = None, ckpt_every_s: float = 240.0,
                 opt_state: dict | None = None, pos_lr_mult: float = 1.0, train_projector: bool = True
                 ) -> dict[str, float]:
    """Train tower + projector (+ heads) on world images; the LM (embeddings, norm) stays frozen.

    The projector side is pulled towards the patch words through the LM's norm and tied head, or, when the encoder
    carries word codes (the word-code recipe), regressed onto the codes.

    ``start``: images an earlier call already trained on (the image stream continues from there).
    ``checkpoint(images_done, optimizer_state)`` is called every ``ckpt_every_s`` seconds so that a long stage can be
    stopped and resumed; ``opt_state`` restores the stage's optimizer on such a resume.

    ``pos_lr_mult`` scales the learning rate of the tower's position embeddings. They start at std 0.02 while the
    patch embedding of an object patch soon has norm ~36, so at the base rate (Adam moves each entry by about ``lr``
    per step) position stays ~2% of a token for tens of thousands of images: the tower is a bag of patches that can
    tell neither where an object is nor how its corner patches fit together into a shape (zoo/TRAINING.md, "The tower
    cannot see where").

    ``train_projector=False`` keeps the projector fixed (a closed-form fit, training/target/projector_fit.py, that the run refits
    after the stage): Adam's first steps would wreck the fit's exact structure and send the tower the gradient of
    a broken map; through the fixed fit the code loss pulls the tower towards features that map onto the codes.
    """
    from specula.world.suites import TRAIN_MIX
    from specula.training.target.code_stages import code_cosine, code_vision_loss

    lm = model.model.language_model
    pos = [p for n, p in model.model.vision_tower.named_parameters() if n.endswith("position_embedding.weight")]
    rest = [p for n, p in model.model.vision_tower.named_parameters() if not n.endswith("position_embedding.weight")]
    if train_projector:
        rest += list(model.model.multi_modal_projector.parameters())
    params = rest + pos  # tower (+ projector): what the gradient clip covers
    opt = torch.optim.AdamW([{"params": rest + list(heads.parameters()), "lr_mult": 1.0},
                             {"params": pos, "lr_mult": pos_lr_mult}], lr=lr, weight_decay=0.01)
    if opt_state is not None:
        try:
            opt.load_state_dict(opt_state)
        except ValueError:  # saved before the position group, or with other heads or a trained projector
            log("vision stage: the saved optimizer's parameters do not map onto this stage's; moments restart")
    for g, mult in zip(opt.param_groups, (1.0, pos_lr_mult)):
        g["lr_mult"] = mult
        g["lr"] = lr * mult  # a resumed stage may run at a new rate
    frozen = [p for p in lm.parameters() if p.requires_grad]
    if not train_projector:
        frozen += [p for p in model.model.multi_modal_projector.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    makers = [m for m in TRAIN_MIX if m[0] in ("vqa", "vqa_single", "caption", "chart", "ocr")]
    bar = tqdm(total=n_images, unit="img", desc="vision stage", mininterval=5.0)
    seen, i, ema = 0, start, {}
    last_ckpt = time.time()
    try:
        while seen < n_images:
            items = []
            while len(items) < batch_images:
                name, maker, task, _ = makers[i % len(makers)]
                s = maker(random.Random(f"specula-vision/{seed}/{name}/{i}"), name, task)
                items.append(encoder.encode(s))
                i += 1
            pix = torch.cat([e.pixel_values for e in items])
            cls = torch.cat([e.patch_classes for e in items])
            feats, img = tower_features(model, pix)
            loss_h = heads.loss(feats, cls)
            if items[0].patch_codes is not None:  # word-code recipe: regress the codes the LM learnt to read
                codes = torch.cat([e.patch_codes for e in items])  # [N, T, H]
                loss_a = code_vision_loss(img, codes)
                cos = code_cosine(img.detach(), codes)
                ema["code_cos"] = 0.95 * ema.get("code_cos", cos) + 0.05 * cos
            else:
                loss_a = patch_loss(model.lm_head(lm.norm(img)).float(), torch.cat([e.patch_targets for e in items]))
            loss = loss_h + aux_weight * loss_a
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            seen += len(pix)
            bar.update(len(pix))
            for k, v in (("heads", loss_h), ("aux_in", loss_a)):
                ema[k] = 0.95 * ema.get(k, float(v.detach())) + 0.05 * float(v.detach())
            bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
            if checkpoint is not None and time.time() - last_ckpt > ckpt_every_s and seen < n_images:
                checkpoint(start + seen, opt.state_dict())
                last_ckpt = time.time()
    finally:
        for p in frozen:
            p.requires_grad_(True)
        bar.close()
    log(f"vision stage: {seen} images, " + ", ".join(f"{k}={v:.3f}" for k, v in ema.items()))
    return ema
