"""``python -m research probe-content``: where an image set's content survives in the LM, layer by layer.

The image-set lanes were steered with linear probes written as throwaway scripts (lost with ``runs/``): a probe
fitted on one half of the object patches reads each patch's colour and shape from one layer's input, and is scored
on the other half. They found that a set patch's colour and shape read 0.98 from the visual tokens but at chance
(0.22-0.28 / 0.26-0.42) at layer 2's input, where an image alone still reads 0.91: the odd hop looked at keys that
held nothing. This is that reading, kept.

The samples are the ``multi_image`` suite's "which image" questions past the gates' indices (their images are
independent: one or two objects each, so a patch that blends in another image's object reads wrong). Each is
read three ways, and every object patch's states are collected at the input of every decoder layer (``layer L`` =
the last layer's output):

- ``set_first``: the first image's patches, the set as the suite asks it;
- ``set_later``: the second and later images' patches, the same forward;
- ``alone``: every image of the set in a prompt of its own (``<image>`` and a question after it), so the same
  patches with nothing before them but the chat template.

Per group and layer: ``colour`` / ``shape``, the held-out accuracy of a ridge classifier (one-vs-rest, closed form,
fitted on the even-numbered sets' patches and scored on the odd-numbered ones, so no image is on both sides), and
``base``, what always answering the fitting half's most frequent class scores.

``--isolate`` reads the sets through ``isolation_mask`` instead of causal attention: each image's tokens see the chat
template and their own image only. The first image of a set then holds exactly what it holds alone, and a later one
differs from alone only by its positions; what the causal reading loses beyond that is what the text and images
before a patch take from it (zoo/TRAINING.md, "Image sets: the text before an image takes its content, and a
finishing stage": the target then shipped read its later images at the base rate, isolated ones as well as alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.world.sample import Sample
from specula.world.tokenizer import USER
from specula.world.vocab import COLOUR_NAMES, SHAPES

PROBE_OFFSET = 40_000  # eval-split indices past the gates' (training/target/evaluate.py), the training checks' and probe-sets'
GROUPS = ("set_first", "set_later", "alone")
ALONE_PROMPT = "<image> What is in the image?"


def ridge_accuracy(x_fit: torch.Tensor, y_fit: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                   n_classes: int, lam: float = 1e-2) -> float:
    """Held-out accuracy of a one-vs-rest ridge classifier. x_fit # [N, H], y_fit # [N] int64 in [0, n_classes),
    likewise the test half. ``lam``: the penalty per standardised feature, relative to the number of patches fitted."""
    if x_fit.shape[0] == 0 or x_test.shape[0] == 0:
        raise ValueError("ridge_accuracy needs patches on both halves")
    x_fit, x_test = x_fit.double(), x_test.double()
    # each feature standardised on the fitting half: a residual stream has a few dimensions hundreds of times larger
    # than the rest, and one penalty for all would then shrink every other dimension to nothing
    mean, std = x_fit.mean(0, keepdim=True), x_fit.std(0, keepdim=True).clamp_min(1e-6)  # [1, H] each
    a, b = (x_fit - mean) / std, (x_test - mean) / std
    targets = torch.nn.functional.one_hot(y_fit, n_classes).double()  # [N, C]
    targets = targets - targets.mean(0, keepdim=True)
    gram = a.T @ a  # [H, H]
    reg = lam * a.shape[0] * torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram + reg, a.T @ targets)  # [H, C]
    return float(((b @ w).argmax(1) == y_test).double().mean())


def base_accuracy(y_fit: torch.Tensor, y_test: torch.Tensor) -> float:
    """What answering the fitting half's most frequent class scores on the test half."""
    return float((y_test == torch.bincount(y_fit).argmax()).double().mean())


def object_labels(patch_words: Sequence[Sequence[str]]) -> tuple[list[int], torch.Tensor]:
    """One image's object patches (indices into its patches) and their (colour, shape) classes # [P, 2] int64."""
    from specula.training.target.batching import patch_classes

    classes = patch_classes([patch_words])[0, :, :2]  # [T, 2]
    keep = [j for j in range(classes.shape[0])
            if 0 <= int(classes[j, 0]) < len(COLOUR_NAMES) and 0 <= int(classes[j, 1]) < len(SHAPES)]
    return keep, classes[keep]


def isolation_mask(input_ids: torch.Tensor, image_id: int, tokens_per_image: int, prefix: int) -> torch.Tensor:
    """Causal attention in which an image's tokens see only their own image and the first ``prefix`` tokens (the
    chat template before the user's words), never another image or any text of the prompt: # [T, T] bool, True =
    attend. input_ids # [T] int64. Text tokens see everything before them, as in plain causal attention."""
    n = input_ids.shape[0]
    is_image = input_ids == image_id  # [T]
    index = torch.where(is_image, (torch.cumsum(is_image.long(), 0) - 1) // tokens_per_image, -1)  # [T] image number
    query, key = index[:, None], index[None, :]  # [T, 1], [1, T]
    in_prefix = torch.arange(n)[None, :] < prefix  # [1, T]
    return torch.ones(n, n, dtype=torch.bool).tril() & ((query < 0) | (key == query) | in_prefix)


def _states(model, input_ids: torch.Tensor, pixel_values: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer's input (and the last output) at every position # [L + 1, T, H] fp32; ``mask`` # [T, T] bool
    (None: causal)."""
    if mask is None:
        attention = torch.ones_like(input_ids)[None]  # [1, T]
    else:  # bool for sdpa, additive for eager (the engine's own conversion)
        from specula.targets.kv import attention_mask

        lm = model.model.language_model
        attention = attention_mask(mask[None, None], lm.config._attn_implementation, lm.dtype)  # [1, 1, T, T]
    out = model(input_ids=input_ids[None], pixel_values=pixel_values, output_hidden_states=True,
                attention_mask=attention)
    return torch.stack([h[0] for h in out.hidden_states]).float()


def collect(model, processor, s: Sample, isolate: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One set's object patches per group: (states # [L + 1, P, H], labels # [P, 2]); ``isolate``: the set read
    with ``isolation_mask`` (what its patches would hold if nothing before them but the template were visible)."""
    from specula.runtime.engine.prompts import encode_prompt
    from specula.training.target.set_referents import set_image_tokens

    image_id = model.config.image_token_id
    ids, pix = encode_prompt(processor, s.prompt, s.images, s.system)
    got = set_image_tokens(s, ids, image_id)
    if got is None:
        raise ValueError(f"{s.kind}: its image tokens do not match its {len(s.images)} images")
    n_tok, pos = got
    mask = None
    if isolate:  # the template before the user's words: everything up to the first user-turn marker
        prefix = int((ids == processor.tokenizer.convert_tokens_to_ids(USER)).nonzero()[0, 0]) + 1
        mask = isolation_mask(ids, image_id, n_tok, prefix)
    states = _states(model, ids, pix, mask)  # [L + 1, T, H]
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {g: [] for g in GROUPS}
    for n, words in enumerate(s.patch_words):
        keep, labels = object_labels(words)
        if not keep:
            continue
        where = [pos[n * n_tok + j] for j in keep]
        parts["set_first" if n == 0 else "set_later"].append((states[:, where], labels))
        alone_ids, alone_pix = encode_prompt(processor, ALONE_PROMPT, [s.images[n]])
        alone_pos = (alone_ids == image_id).nonzero()[:, 0]
        parts["alone"].append((_states(model, alone_ids, alone_pix)[:, alone_pos[keep]], labels))
    return {g: (torch.cat([p[0] for p in v], 1), torch.cat([p[1] for p in v])) for g, v in parts.items() if v}


@torch.no_grad()
def probe_content(model, processor, n: int = 60, seed: int = 0, progress: bool = True, isolate: bool = False) -> dict:
    """The reading above over the first ``n`` "which image" sets past ``PROBE_OFFSET`` (JSON-ready); ``isolate``:
    the sets read with ``isolation_mask``."""
    from tqdm import tqdm

    from specula.world.suites import generate

    halves: dict[str, tuple[list, list]] = {g: ([], []) for g in GROUPS}  # per group: (fit, test) parts
    sets, i = 0, 0
    bar = tqdm(total=n, desc="probe content", unit="set", disable=not progress)
    while sets < n:
        s = generate("multi_image", "eval", PROBE_OFFSET + i, seed)
        i += 1
        if s.kind != "multi/which":
            continue
        for g, part in collect(model, processor, s, isolate).items():
            halves[g][sets % 2].append(part)
        sets += 1
        bar.update()
    bar.close()
    layers = model.config.text_config.num_hidden_layers
    report: dict = {"sets": n, "layers": layers, "isolated": isolate, "groups": {}}
    for g, (fit, test) in halves.items():
        if not fit or not test:
            continue
        x_fit, y_fit = torch.cat([p[0] for p in fit], 1), torch.cat([p[1] for p in fit])  # [L+1, N, H], [N, 2]
        x_test, y_test = torch.cat([p[0] for p in test], 1), torch.cat([p[1] for p in test])
        row = {"patches": [int(y_fit.shape[0]), int(y_test.shape[0])],
               "base": [round(base_accuracy(y_fit[:, a], y_test[:, a]), 3) for a in range(2)], "by_layer": []}
        for layer in range(layers + 1):
            row["by_layer"].append([round(ridge_accuracy(x_fit[layer], y_fit[:, a], x_test[layer], y_test[:, a],
                                                         c), 3) for a, c in enumerate((len(COLOUR_NAMES), len(SHAPES)))])
        report["groups"][g] = row
    return report


def markdown(report: dict) -> str:
    """One row per layer input, colour / shape read held out per group."""
    groups = [g for g in GROUPS if g in report["groups"]]
    lines = ["| where | " + " | ".join(f"{g}: colour / shape" for g in groups) + " |",
             "| --- |" + " ---: |" * len(groups)]
    for layer in range(report["layers"] + 1):
        name = f"layer {layer}'s input" if layer < report["layers"] else "last layer's output"
        cells = [f"{r[0]:.2f} / {r[1]:.2f}" for r in (report["groups"][g]["by_layer"][layer] for g in groups)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    base = [report["groups"][g]["base"] for g in groups]
    lines.append("| always the most frequent class | " + " | ".join(f"{b[0]:.2f} / {b[1]:.2f}" for b in base) + " |")
    return "\n".join(lines)


def probe_content_cli(args) -> int:
    from research.probe_output import emit, load_source

    if args.n < 2:
        raise SystemExit("--n must be at least 2 (the probe fits on half the sets and scores on the other half)")
    model, processor = load_source(args)
    report = probe_content(model, processor, n=args.n, seed=args.seed, isolate=args.isolate)
    report["model"] = args.checkpoint or args.model
    emit(report, markdown(report), args.out, "probe_content", args.json)
    return 0
