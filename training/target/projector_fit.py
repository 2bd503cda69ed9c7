"""Closed-form projector alignment: the projector that best maps the tower's features onto the word codes.

In the word-code recipe the projector is trained by AdamW to regress the codes (``vision_stage``). That regression
is badly conditioned: what says where a patch is, or which corner of a shape it shows, is a small-variance direction
of the tower's features, and gradient descent learns such directions slowly. Measured on a 48,736-image tower
(zoo/TRAINING.md, "The tower cannot see where"): the trained MLP projector decodes shape 0.82, size 0.83, place 0.37, while a
ridge-regression *linear* map from the same features, fitted in closed form on 960 training images, decodes shape
0.92, size 0.93, place 0.49.

``fit_projector`` solves that ridge regression (features of the configured ``vision_feature_layer``s, with a bias,
onto each patch's code; background patches included, their code is zero) and writes the solution into the stock
LLaVA projector ``linear_2(gelu(linear_1(x)))`` so that it computes the linear map:

    linear_1 = [W; b] + shift,   linear_2 = I, bias -shift

GELU(z) = z * Phi(z) is the identity to within z * Phi(-z) when z is well above zero, and ``shift`` puts every
pre-activation there (the fit checks the worst case on the data it saw; ``shift`` grows until the error is below
``tol``). This needs the projector's hidden width to equal the LM width, which LLaVA's projector has. The model
stays a stock ``LlavaForConditionalGeneration``; training goes on from there.

``gate_background``: background patches should come out as exact zeros (an LM trained on zero backgrounds is thrown
by small vectors there: RMSNorm blows them up). A closed-form linear score s(x) separates object from background
patches (ridge onto +1 / -1), and it is added along the all-ones direction of every hidden unit:

    z = W x + b + (shift + k (s(x) - theta)) 1,   linear_2 = P = I - 1 v^T,  bias 0

with v orthogonal to the span of W's columns and b and v^T 1 = 1, so P removes the ones direction and keeps W x + b.
Object patches (s above theta) stay in GELU's identity range and come out as W x + b; background patches (s well
below theta) drive every hidden unit far negative, where GELU is 0, and come out as zero. theta is a low quantile of
the object scores, k makes the high quantile of the background scores close the gate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class ProjectorFit:
    images: int  # images the map was fitted on
    patches: int  # patches of the bounded sample (first <=256 images) that the losses and gate shares are measured on
    shift: float
    max_gelu_error: float  # worst |gelu(z) - z| over the pre-activations of the reported patches
    loss_before: float  # code regression loss (squared error per patch, summed over the width), first <=256 images
    loss_after: float
    gate_object_open: float = 1.0  # share of object patches whose gate is open (score above theta), gate_background
    gate_background_closed: float = 0.0  # share of background patches fully closed
    background_norm: float = 0.0  # mean output norm on background patches after the fit


def _features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """The projector's input exactly as LLaVA builds it  # [N, T, D_in]"""
    from specula.training.target.vision_heads import projector_input

    return projector_input(model, model.model.vision_tower(pixel_values, output_hidden_states=True).hidden_states)


@torch.no_grad()
def write_gated(proj, w: torch.Tensor, b: torch.Tensor, shift: float, ws: torch.Tensor, cs: float, k: float) -> None:
    """Make ``proj`` compute W x + b where the gate score ws.x + cs is >= 0 and 0 where k (ws.x + cs) is far below
    -(shift + |W x + b|) (see the module docstring).  w [H, D_in]; b [H]; ws [D_in]"""
    width = w.shape[0]
    u_, sv, _ = torch.linalg.svd(torch.cat([w, b[:, None]], 1).double(), full_matrices=False)
    span = u_[:, sv > sv.max() * 1e-9]  # [H, rank] orthonormal basis of W's columns and b
    ones = torch.ones(width, dtype=torch.double)
    u = ones - span @ (span.T @ ones)
    if float(u @ ones) < 1e-6:
        raise ValueError("the all-ones direction lies in the map's span: no room for the gate")
    v = (u / (u @ ones)).float()  # v^T 1 = 1, v orthogonal to the span
    dtype = proj.linear_1.weight.dtype
    proj.linear_1.weight.copy_((w + k * torch.outer(torch.ones(width), ws)).to(dtype))
    proj.linear_1.bias.copy_((b + shift + k * cs).to(dtype))
    proj.linear_2.weight.copy_((torch.eye(width) - torch.outer(torch.ones(width), v)).to(dtype))
    proj.linear_2.bias.zero_()


@torch.no_grad()
def fit_projector(model, encoder, n_images: int, seed: int, ridge: float = 1.0, batch_images: int = 32,
                  tol: float = 1e-3, gate_background: bool = False, log=print) -> ProjectorFit:
    """Fit the projector in closed form on ``n_images`` training-mix images (the vision stage's image makers, from
    their own stream) and write it into the model. ``encoder`` must carry word codes."""
    from specula.world.suites import TRAIN_MIX

    if encoder.codes is None:
        raise ValueError("fit_projector needs an Encoder with word codes")
    if n_images <= 0:
        raise ValueError(f"n_images must be positive, got {n_images}")
    proj = model.model.multi_modal_projector
    width = proj.linear_2.out_features
    if proj.linear_1.out_features != width or proj.linear_2.in_features != width:
        raise ValueError(f"projector hidden width {proj.linear_1.out_features} must equal the LM width {width}")
    was_training = model.training
    model.eval()
    makers = [m for m in TRAIN_MIX if m[0] in ("vqa", "vqa_single", "caption", "chart", "ocr")]
    xtx = xty = None
    feats, codes = [], []
    xts = None  # [D_in + 1] a^T t for the object/background score
    done, i = 0, 0
    bar = tqdm(total=n_images, unit="img", desc="projector fit", mininterval=5.0)
    while done < n_images:
        items = []
        while len(items) < min(batch_images, n_images - done):
            name, maker, task, _ = makers[i % len(makers)]
            s = maker(random.Random(f"specula-projector-fit/{seed}/{name}/{i}"), name, task)
            items.append(encoder.encode(s))
            i += 1
        x = _features(model, torch.cat([e.pixel_values for e in items])).flatten(0, 1).double()  # [n*T, D_in]
        y = torch.cat([e.patch_codes for e in items]).flatten(0, 1).double()  # [n*T, H]
        a = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # [n*T, D_in + 1]
        xtx = a.T @ a if xtx is None else xtx + a.T @ a
        xty = a.T @ y if xty is None else xty + a.T @ y
        t = (y.norm(dim=-1) > 0).double() * 2 - 1  # [n*T] +1 object, -1 background
        xts = a.T @ t if xts is None else xts + a.T @ t
        if done < 256:  # a bounded sample to report the loss on
            feats.append(x.float())
            codes.append(y.float())
        done += len(items)
        bar.update(len(items))
    bar.close()
    reg = ridge * torch.eye(xtx.shape[0], dtype=xtx.dtype)
    reg[-1, -1] = 0.0  # the bias is not shrunk
    sol = torch.linalg.solve(xtx + reg, xty).float()  # [D_in + 1, H]
    w, b = sol[:-1].T, sol[-1]  # [H, D_in], [H]
    x, y = torch.cat(feats), torch.cat(codes)  # [P, D_in], [P, H]
    lin = x @ w.T + b  # [P, H]
    before = float((proj(x) - y).pow(2).sum(-1).mean())
    shift = 3.0  # then grown until gelu is the identity on every fitted pre-activation
    while True:
        z = lin + shift
        err = float((torch.nn.functional.gelu(z) - z).abs().max())
        if err < tol or shift > 64:
            break
        shift *= 1.5
    dtype = proj.linear_1.weight.dtype
    if not gate_background:
        proj.linear_1.weight.copy_(w.to(dtype))
        proj.linear_1.bias.copy_((b + shift).to(dtype))
        proj.linear_2.weight.copy_(torch.eye(width, dtype=dtype))
        proj.linear_2.bias.fill_(-shift)
        gate = (1.0, 0.0)
    else:
        score = torch.linalg.solve(xtx + reg, xts).float()  # [D_in + 1]
        ws, cs = score[:-1], float(score[-1])
        s_all = x @ ws + cs  # [P]
        obj = y.norm(dim=-1) > 0  # [P]
        if not obj.any() or obj.all():
            raise ValueError("gate_background needs both object and background patches among the fitted images")
        theta = float(torch.quantile(s_all[obj], 0.02))
        closed_at = float(torch.quantile(s_all[~obj], 0.98))
        if closed_at >= theta:
            raise ValueError(f"object and background patches do not separate (98% of background scores below "
                             f"{closed_at:.3f}, 98% of object scores above {theta:.3f})")
        need = 10.0 + shift + float(lin.abs().max())  # pre-activation depth at which GELU is 0 to ~1e-22
        k = need / (theta - closed_at)
        write_gated(proj, w, b, shift, ws, cs - theta, k)
        gate = (float((s_all[obj] >= theta).float().mean()), float((s_all[~obj] <= closed_at).float().mean()))
    out = proj(x)  # [P, H]
    after = float((out - y).pow(2).sum(-1).mean())
    bg_norm = float(out[y.norm(dim=-1) == 0].norm(dim=-1).mean()) if (y.norm(dim=-1) == 0).any() else 0.0
    model.train(was_training)
    fit = ProjectorFit(n_images, len(x), shift, err, before, after, gate[0], gate[1], bg_norm)
    log(f"projector fit: {n_images} images, {len(x)} patches, code loss {before:.4f} -> {after:.4f} "
        f"(shift {shift:g}, max gelu error {err:.2e}, background norm {bg_norm:.4f}"
        + (f", gate open on {gate[0]:.3f} of objects, closed on {gate[1]:.3f} of background)" if gate_background else ")"))
    return fit
