"""Quality gates of the embedded target: image-grounded accuracy, the same questions on a blank image, caption recall."""

from __future__ import annotations

import dataclasses
import re

import torch
from PIL import Image

from specula.world.sample import IMAGE_SIZE, Sample
from specula.world.vocab import COLOUR_NAMES, ORDINALS, SHAPES
from specula.runtime.engine.prompts import encode_prompt


def normalize(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


def blank_like(s: Sample, rng_colour: tuple[int, int, int] = (128, 128, 128)) -> Sample:
    """The same question with every image replaced by a plain gray image."""
    blank = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rng_colour)
    return dataclasses.replace(s, images=tuple(blank for _ in s.images), followups=())


@torch.inference_mode()
def greedy_answer(model, processor, s: Sample, max_new_tokens: int) -> str:
    ids, pix = encode_prompt(processor, s.prompt, s.images, s.system)
    inputs = {"input_ids": ids[None].to(model.device)}
    if pix is not None:
        inputs["pixel_values"] = pix.to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id)
    return processor.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def answer_with_visual(model, processor, s: Sample, visual: torch.Tensor, max_new_tokens: int = 8) -> str:
    """Greedy answer with the given visual tokens [n_img * T, H] in place of the sample's image tokens."""
    ids, _ = encode_prompt(processor, s.prompt, s.images)
    embeds = model.get_input_embeddings()(ids[None])  # [1, L, H]
    embeds[ids[None] == model.config.image_token_id] = visual.to(embeds.dtype)
    lm, out = model.model.language_model, []
    for _ in range(max_new_tokens):  # short answers: recomputing the prefix is cheaper than managing a cache here
        t = int(model.lm_head(lm(inputs_embeds=embeds).last_hidden_state[:, -1]).argmax(-1))
        if t == processor.tokenizer.eos_token_id:
            break
        out.append(t)
        embeds = torch.cat([embeds, model.get_input_embeddings()(torch.tensor([[t]]))], 1)
    return processor.tokenizer.decode(out, skip_special_tokens=True)


def short_answers(model, processor, samples: list[Sample], blank: bool = False) -> list[str]:
    """Per sample: the greedy short answer, normalised and cut at its first full stop."""
    out = []
    for s in samples:
        pred = greedy_answer(model, processor, blank_like(s) if blank else s, max_new_tokens=8)
        out.append(normalize(pred.split(".")[0]))
    return out


def short_answer_hits(model, processor, samples: list[Sample], blank: bool = False,
                      answers: list[str] | None = None) -> list[bool]:
    """Per sample: does the greedy answer (normalised) equal the sample's short answer? ``answers``: those answers
    already made (``short_answers``)."""
    answers = short_answers(model, processor, samples, blank) if answers is None else answers
    return [a == normalize(s.answer or "") for s, a in zip(samples, answers)]


def which_image_by_place(samples: list[Sample], answers: list[str]) -> dict[str, dict]:
    """The image-set questions that ask the colour in the n-th image, by n: how often the answer is right, and how
    often it is the colour of the *first* image's object instead (an LM that reads only the first image of a set
    answers that for every n)."""
    out: dict[str, dict] = {}
    for s, a in zip(samples, answers):
        if not s.kind.endswith("/which"):
            continue
        place = next(i for i, o in enumerate(ORDINALS) if f" {o} image" in s.prompt)
        first = [w[0] for w in s.patch_words[0] if w]
        r = out.setdefault(ORDINALS[place], {"n": 0, "exact": 0.0, "first_image_colour": 0.0})
        r["n"] += 1
        r["exact"] += a == normalize(s.answer or "")
        r["first_image_colour"] += bool(first) and a == first[0]
    for r in out.values():
        r["exact"] /= r["n"]
        r["first_image_colour"] /= r["n"]
    return {o: out[o] for o in ORDINALS if o in out}


def short_answer_accuracy(model, processor, samples: list[Sample], blank: bool = False) -> float:
    """Exact match of the greedy answer (normalised) against the sample's short answer."""
    return sum(short_answer_hits(model, processor, samples, blank)) / max(1, len(samples))


def by_question_type(samples: list[Sample], hits: list[bool], blank_hits: list[bool]) -> dict[str, dict]:
    """Accuracy with the image and with a blank one per question type (the part of ``kind`` after "/")."""
    out: dict[str, dict] = {}
    for s, h, b in zip(samples, hits, blank_hits):
        r = out.setdefault(s.kind.split("/", 1)[-1], {"n": 0, "exact": 0.0, "exact_blank_image": 0.0})
        r["n"] += 1
        r["exact"] += h
        r["exact_blank_image"] += b
    for r in out.values():
        r["exact"] /= r["n"]
        r["exact_blank_image"] /= r["n"]
    return dict(sorted(out.items()))


def answers_by_type(samples: list[Sample], answers: list[str], top: int = 4) -> dict[str, dict]:
    """What the model answers per question type (the part of ``kind`` after "/"): its ``top`` most frequent answers
    with their counts, and the share of answers that are *some* right answer of that type in these samples
    (``in_answer_set``). A type answered off its answer set (an ordinal question answered "star") is a format the LM
    never learnt, not a reading it gets wrong; one answered with a single word whatever the image is a prior."""
    gold: dict[str, set[str]] = {}
    given: dict[str, list[str]] = {}
    for s, a in zip(samples, answers):
        qtype = s.kind.split("/", 1)[-1]
        gold.setdefault(qtype, set()).add(normalize(s.answer or ""))
        given.setdefault(qtype, []).append(a)
    out = {}
    for qtype, said in sorted(given.items()):
        counts: dict[str, int] = {}
        for a in said:
            counts[a] = counts.get(a, 0) + 1
        common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        out[qtype] = {"n": len(said), "top": dict(common),
                      "in_answer_set": sum(a in gold[qtype] for a in said) / len(said)}
    return out


def chance_level(samples: list[Sample]) -> float | None:
    """Mean of 1 / n_choices over the samples (balanced questions); None where the task has no closed answer set."""
    if not any(s.n_choices for s in samples):
        return None
    return sum(1.0 / s.n_choices for s in samples if s.n_choices) / max(1, len(samples))


CAPTION_TOKENS = 96  # a caption's greedy decode length in the gate (a scan listing of nine cells is 40-60 tokens)


def caption_attribute_recall(model, processor, samples: list[Sample], max_new_tokens: int = CAPTION_TOKENS) -> float:
    """Share of required attribute words (colours, shapes, ...) that the generated caption names."""
    return attribute_recall(samples, [greedy_answer(model, processor, s, max_new_tokens) for s in samples])


def attribute_recall(samples: list[Sample], captions: list[str]) -> float:
    """Share of the samples' required attribute words that their ``captions`` name (an attribute of several words,
    "dark gray", counts only when all of them appear)."""
    found = total = 0
    for s, text in zip(samples, captions, strict=True):
        words = caption_words(text)
        for a in s.attributes:
            total += 1
            found += all(w in words for w in a.lower().split())
    return found / max(1, total)


# an object named by colour and shape: "a small red circle", "a red circle of large size", "top, a large red circle"
_OBJECT_PHRASE = re.compile(rf"\b({'|'.join(COLOUR_NAMES)}) ({'|'.join(SHAPES)})\b")


def named_objects(text: str) -> set[tuple[str, str]]:
    """The (colour, shape) pairs a caption names as one object, in any of the world's caption forms: a colour word
    right before a shape word (free-form and cell-scan captions), or a listing entry that opens with a colour and
    goes on with shapes ("red, a small circle at the top and a large star in the center": red circle, red star)."""
    t = text.lower()
    out = set(_OBJECT_PHRASE.findall(t))
    listing = t.split(":", 1)[1] if ":" in t else t
    for entry in listing.split(".")[0].split(";"):
        head, _, rest = entry.partition(",")
        if head.strip() in COLOUR_NAMES:
            out |= {(head.strip(), w) for w in re.findall(r"[a-z]+", rest) if w in SHAPES}
    return out


def _object_pairs(samples: list[Sample], captions: list[str]) -> list[tuple[set, set]] | None:
    """(the objects a caption names, the objects its scene holds) as (colour, shape) pairs, for the samples that list
    their objects that way (the scene captions do: ``attributes`` = colour, shape, colour, shape, ...); None where
    none does."""
    out = []
    for s, text in zip(samples, captions, strict=True):
        pairs = list(zip(s.attributes[::2], s.attributes[1::2]))
        if len(s.attributes) % 2 or not all(c in COLOUR_NAMES and sh in SHAPES for c, sh in pairs):
            continue
        out.append((named_objects(text), set(pairs)))
    return out or None


def object_precision(samples: list[Sample], captions: list[str]) -> float | None:
    """Share of the objects the ``captions`` name (``named_objects``, once per caption and object) that their
    scenes hold. Recall alone rewards a caption that fills empty places with copies of an object it has named; this
    is the other side. None where the samples do not list their objects as (colour, shape) pairs."""
    both = _object_pairs(samples, captions)
    return None if both is None else sum(len(g & w) for g, w in both) / max(1, sum(len(g) for g, _ in both))


def object_recall(samples: list[Sample], captions: list[str]) -> float | None:
    """Share of the scenes' objects (distinct colour-shape pairs) that the ``captions`` name with colour and shape
    together (``named_objects``). Stricter than the attribute recall of the gate, which counts a colour word and a
    shape word wherever they stand: a listing that names every colour ("green, no object; ...") has all the colour
    words of any scene (zoo/TRAINING.md, "What a cell's phrase gets wrong"). None where the samples do not list
    their objects as (colour, shape) pairs."""
    both = _object_pairs(samples, captions)
    return None if both is None else sum(len(g & w) for g, w in both) / max(1, sum(len(w) for _, w in both))


def caption_words(text: str) -> set[str]:
    """The words of a caption, lower-cased, without punctuation ("a red cross; a blue star." names "cross")."""
    return set(re.findall(r"[a-z]+", text.lower()))
