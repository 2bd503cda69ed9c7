"""``python -m research probe``: where grounding fails — the vision path, or the LM's own lookup.

Three accuracies on the same held-out questions, per question type:

- ``real``    the target as it is (visual tokens from its tower + projector);
- ``oracle``  the visual tokens of patches that show an object replaced by the patch's words' embeddings (colour,
              shape, size, place; summed, rescaled to the real token's RMS): what a perfect projector into the
              LM's word space would hand the LM. If ``oracle`` is no better than ``real``, the LM cannot read
              the tokens however good they are, and the vision path is not what to train;
- ``described`` the scene described in words (the world's text/scene questions): the LM's copy-from-context
              skill with no vision at all; ``described_by_objects`` splits it by the number of objects in the
              scene. One object needs a copy; two or more need binding (which colour goes with which shape,
              by adjacency in the sentence), the part small LMs learn last.

``real_by_objects`` splits ``real`` by the number of objects in the image, and ``lookup_errors`` sorts the answers
to lookup questions (colour, shape, size, where) about images with two or more objects: ``right``,
``other_object`` (the attribute of another object in the image: the LM read the image but picked the wrong
object, a *selection* failure) or ``absent`` (an attribute no object has: a *reading* failure). The word-code
recipe's LM, with perfect codes, answers 0.81 on one-object images and 0.31 (blank level) on five-object ones, and
nearly every wrong lookup is ``other_object``: selection, not reading, is what it has not learnt.

And ``word_embeddings``: per attribute (colour, shape, size, place) the mean norm of the LM's word embeddings and
the mean cosine between them. With tied embeddings, words the LM cannot yet predict collapse towards one
direction (shape words in the first shipped target: cosine 0.84, half the norm of the colour words), so a visual
token built from them says the attribute only faintly.
"""

from __future__ import annotations

import json

import torch

from specula.runtime.engine.prompts import encode_prompt
from specula.world.sample import Sample
from specula.world.suites import generate
from specula.world.vocab import COLOUR_NAMES, POSITIONS, SHAPES, SIZES
from specula.training.target.evaluate import EVAL_OFFSET
from specula.training.target.quality import answer_with_visual, greedy_answer, normalize


def oracle_visual(model, word_ids: list[list[int]], real: torch.Tensor) -> torch.Tensor:
    """real [T, H] projected visual tokens of one image; word_ids[t] the patch's word token ids (empty: keep) ->
    [T, H] with each object patch replaced by the sum of its words' embeddings at the real token's RMS."""
    emb = model.get_input_embeddings().weight  # [V, H]
    out = real.clone()
    for t, ids in enumerate(word_ids):
        if ids:
            v = emb[ids].sum(0)  # [H]
            out[t] = v / v.pow(2).mean().sqrt() * real[t].pow(2).mean().sqrt()
    return out


LOOKUP_SLOTS = {"colour": (0,), "shape": (1,), "size": (2,), "where": (3, 4)}  # in a patch's words tuple


def image_objects(s: Sample, image: int = 0) -> set[tuple[str, ...]]:
    """The objects of one scene image, as their patch-word tuples (colour, shape, size, *place)."""
    return {w for w in s.patch_words[image] if w}


def classify_lookup(s: Sample, pred: str) -> str | None:
    """``right`` / ``other_object`` / ``absent`` for a lookup question (module docstring); None for other kinds."""
    slots = LOOKUP_SLOTS.get(s.kind.split("/", 1)[-1])
    if slots is None or not s.patch_words:
        return None
    pred = normalize(pred.split(".")[0])
    if pred == normalize(s.answer or ""):
        return "right"
    values = {normalize(" ".join(w[i] for i in slots if i < len(w))) for w in image_objects(s)}
    return "other_object" if pred in values else "absent"


@torch.inference_mode()
def word_geometry(model, tokenizer) -> dict[str, dict[str, float]]:
    """Per attribute group: mean norm of its words' input embeddings and their mean pairwise cosine."""
    emb = model.get_input_embeddings().weight.detach().float()  # [V, H]
    places = sorted({w for p in POSITIONS.values() for w in p.split()})
    out = {}
    for name, words in (("colour", COLOUR_NAMES), ("shape", SHAPES), ("size", tuple(SIZES)), ("place", places)):
        ids = [t[0] for t in (tokenizer(w, add_special_tokens=False).input_ids for w in words) if len(t) == 1]
        v = emb[ids]  # [n, H]
        u = torch.nn.functional.normalize(v, dim=-1)
        cos = (u @ u.T).fill_diagonal_(0).sum() / max(1, len(ids) * (len(ids) - 1))
        out[name] = {"words": len(ids), "norm": round(float(v.norm(dim=-1).mean()), 4), "cosine": round(float(cos), 4)}
    return out


def probe(model, processor, n: int = 100, seed: int = 0) -> dict:
    from specula.training.target.batching import Encoder

    enc = Encoder(processor)
    rows: dict[str, dict] = {}
    by_image_objects: dict[int, list[int]] = {}
    lookup = {"right": 0, "other_object": 0, "absent": 0}

    def hit(pred: str, s: Sample) -> bool:
        return normalize(pred.split(".")[0]) == normalize(s.answer or "")

    for i in range(n):
        s = generate("vqa", "eval", EVAL_OFFSET + i, seed)
        _, pix = encode_prompt(processor, s.prompt, s.images)
        real = model.model.get_image_features(pixel_values=pix, return_dict=True).pooler_output[0]  # [T, H]
        words = [[w for w in map(enc.word_id, ws) if w >= 0] for ws in s.patch_words[0]]
        r = rows.setdefault(s.kind.split("/", 1)[-1], {"n": 0, "real": 0.0, "oracle": 0.0})
        r["n"] += 1
        pred = answer_with_visual(model, processor, s, real)
        r["real"] += hit(pred, s)
        n_obj = len({w[:2] for w in image_objects(s)})
        o = by_image_objects.setdefault(n_obj, [0, 0])
        o[0] += 1
        o[1] += hit(pred, s)
        kind = classify_lookup(s, pred) if n_obj >= 2 else None
        if kind is not None:
            lookup[kind] += 1
        r["oracle"] += hit(answer_with_visual(model, processor, s, oracle_visual(model, words, real)), s)
    described = [s for s in (generate("text", "eval", EVAL_OFFSET + i, seed) for i in range(4 * n))
                 if s.kind == "text/scene"][:n]
    out = {"n": n, "by_type": {}, "real": 0.0, "oracle": 0.0}
    for k, r in sorted(rows.items()):
        out["real"] += r["real"] / n
        out["oracle"] += r["oracle"] / n
        out["by_type"][k] = {"n": r["n"], "real": r["real"] / r["n"], "oracle": r["oracle"] / r["n"]}
    out["real_by_objects"] = {k: {"n": n_, "exact": h / n_} for k, (n_, h) in sorted(by_image_objects.items())}
    out["lookup_errors"] = lookup
    by_objects: dict[int, list[int]] = {}
    for s in described:
        r = by_objects.setdefault(scene_objects(s.prompt), [0, 0])
        r[0] += 1
        r[1] += hit(greedy_answer(model, processor, s, 8), s)
    out["described"] = sum(h for _, h in by_objects.values()) / max(1, len(described))
    out["described_n"] = len(described)
    out["described_by_objects"] = {k: {"n": n_, "exact": h / n_} for k, (n_, h) in sorted(by_objects.items())}
    out["word_embeddings"] = word_geometry(model, processor.tokenizer)
    return out


def scene_objects(prompt: str) -> int:
    """Objects in a described scene: shape words in its first sentence ("Imagine a large red circle in the top
    left and a small blue star in the center. ..." -> 2)."""
    scene = prompt.split(".")[0].lower().split()
    return sum(w.strip(",") in SHAPES for w in scene)


def probe_cli(args) -> int:
    from specula.training.target.evaluate import load_model

    model, processor = load_model(args.model)
    r = probe(model, processor, n=args.n)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"vqa (n={r['n']}): real {r['real']:.3f}  oracle visual tokens {r['oracle']:.3f}")
    for k, t in r["by_type"].items():
        print(f"  {k:14s} n={t['n']:<4d} real={t['real']:.3f}  oracle={t['oracle']:.3f}")
    print("vqa by objects in the image: " + ", ".join(
        f"{k}: {t['exact']:.2f} (n={t['n']})" for k, t in r["real_by_objects"].items()))
    e = r["lookup_errors"]
    print(f"lookups with 2+ objects: right {e['right']}, another object's attribute {e['other_object']} "
          f"(selection), an attribute no object has {e['absent']} (reading)")
    print(f"described scene (n={r['described_n']}): {r['described']:.3f}  by objects in the scene: " + ", ".join(
        f"{k}: {t['exact']:.2f} (n={t['n']})" for k, t in r["described_by_objects"].items()))
    print("word embeddings (mean norm, mean cosine between the words): " + ", ".join(
        f"{k} {g['norm']:.2f} / {g['cosine']:.2f}" for k, g in r["word_embeddings"].items()))
    return 0
