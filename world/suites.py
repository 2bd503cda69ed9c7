"""Named, seeded suites and the training mix.

Every sample is a pure function of (suite, split, index): ``random.Random`` seeded with that string. The
``train`` and ``eval`` splits use different seed strings, so evaluation suites are disjoint from training data
(checked by a test on image bytes). The evaluation suites mirror the seed papers' benchmarks:

| suite | task | mirrors |
| --- | --- | --- |
| caption | detailed scene captions | COCO / NoCaps |
| vqa | short-answer scene questions | GQA / VQAv2 |
| reasoning | answer + short explanation | ScienceQA / LLaVA-Bench |
| chart | reading bar / line / pie charts | ChartQA |
| ocr | reading words and numbers on signs | TextVQA / OCRBench |
| multi_image | 2-5 images: odd one out, count across, compare | NLVR2 / Mantis |
| video | 4-8 frames of a moving object | MSVD / MVBench |
| text | text-only conversations | (text-only stages) |
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

from specula.world import charts, image_sets, placed, scene, signs, text_only
from specula.world.sample import Sample

Maker = Callable[[random.Random, str, str], Sample]


@dataclass(frozen=True)
class Suite:
    name: str
    make: Maker
    task: str
    mirrors: str


SUITES: dict[str, Suite] = {
    "caption": Suite("caption", scene.make, "caption", "COCO / NoCaps"),
    "vqa": Suite("vqa", scene.make, "vqa", "GQA / VQAv2"),
    "reasoning": Suite("reasoning", scene.make, "reasoning", "ScienceQA / LLaVA-Bench"),
    "chart": Suite("chart", charts.make, "qa", "ChartQA"),
    "ocr": Suite("ocr", signs.make, "qa", "TextVQA / OCRBench"),
    "multi_image": Suite("multi_image", image_sets.make_multi, "qa", "NLVR2 / Mantis"),
    "video": Suite("video", image_sets.make_video, "qa", "MSVD / MVBench"),
    "text": Suite("text", text_only.make, "text", "text-only conversations"),
}


def _single_object_vqa(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "vqa", n_min=1, n_max=1)


def _few_object_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "caption", n_min=1, n_max=2)


def _scan_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "caption", scan=True)


def _few_object_scan_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "caption", n_min=1, n_max=2, scan=True)


def _colour_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "caption", by_colour=True)


def _few_object_colour_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make(rng, suite, "caption", n_min=1, n_max=2, by_colour=True)


# (name, maker, task, weight): what the target's training draws from. Captions of charts, signs, image sets and
# videos are training-only tasks; the curriculum entries (single-object VQA, short captions) start heavy and fade.
TRAIN_MIX: tuple[tuple[str, Maker, str, float], ...] = (
    ("vqa", scene.make, "vqa", 3.0),
    ("vqa_single", _single_object_vqa, "vqa", 1.0),
    ("caption", scene.make, "caption", 2.0),
    ("caption_short", _few_object_caption, "caption", 1.0),
    ("reasoning", scene.make, "reasoning", 1.0),
    ("chart", charts.make, "qa", 1.0),
    ("chart_caption", charts.make, "caption", 0.3),
    ("ocr", signs.make, "qa", 1.0),
    ("ocr_caption", signs.make, "caption", 0.3),
    ("multi_image", image_sets.make_multi, "qa", 0.6),
    ("multi_caption", image_sets.make_multi, "caption", 0.2),
    ("video", image_sets.make_video, "qa", 0.5),
    ("video_caption", image_sets.make_video, "caption", 0.2),
    ("text", text_only.make, "text", 1.0),
)


def _vqa_dialogue(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make_dialogue(rng, suite, task, n_turns=12)


def _few_object_dialogue(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make_dialogue(rng, suite, task, n_turns=8, n_min=1, n_max=2)


def _confusable_dialogue(rng: random.Random, suite: str, task: str) -> Sample:
    return scene.make_dialogue(rng, suite, task, n_turns=12, n_min=3, n_max=5, confusable=True)


# The grounding mix: scene questions come as 12-turn dialogues about one image (first turn in the evaluation
# format), so the answer signal per image is ~10x that of TRAIN_MIX at ~2x the tokens; scenes described in words get
# the same dialogues (the LM first has to learn the lookup itself: trained on TRAIN_MIX it answered "where" questions
# about a described scene 0/9); the other tasks stay in at lower weight so they are not forgotten.
DIALOGUE_MIX: tuple[tuple[str, Maker, str, float], ...] = (
    ("vqa_dialogue", _vqa_dialogue, "vqa", 4.0),
    ("vqa_dialogue_few", _few_object_dialogue, "vqa", 1.0),
    ("caption", scene.make, "caption", 2.0),
    ("caption_short", _few_object_caption, "caption", 0.5),
    ("reasoning", scene.make, "reasoning", 0.7),
    ("chart", charts.make, "qa", 0.8),
    ("chart_caption", charts.make, "caption", 0.2),
    ("ocr", signs.make, "qa", 0.8),
    ("ocr_caption", signs.make, "caption", 0.2),
    ("multi_image", image_sets.make_multi, "qa", 0.5),
    ("multi_caption", image_sets.make_multi, "caption", 0.1),
    ("video", image_sets.make_video, "qa", 0.4),
    ("video_caption", image_sets.make_video, "caption", 0.1),
    ("text", text_only.make, "text", 0.5),
    ("text_scene_dialogue", text_only.make_scene_dialogue, "text", 2.0),
)

# The lookup phase: mostly described-scene dialogues (no image: ~3x the samples per second), for an LM that has not
# yet learnt to copy an attribute of a named object out of its context (the shipped target answered such questions
# about a one-object scene wrongly: "Where is the triangle?" after "a large orange triangle in the top right").
LOOKUP_MIX: tuple[tuple[str, Maker, str, float], ...] = (
    ("text_scene_dialogue", text_only.make_scene_dialogue, "text", 1.0),
    ("vqa_dialogue", _vqa_dialogue, "vqa", 0.2),
    ("caption", scene.make, "caption", 0.1),
)

# The scene phase, for the word-code LM stage: almost only scene dialogues (the harness that took a 2-layer LM on
# codes to 0.85 held-out VQA trained on nothing else; the dialogue mix gives them a third of its samples), with a
# little captioning and described scenes so the LM keeps its language.
SCENES_MIX: tuple[tuple[str, Maker, str, float], ...] = (
    ("vqa_dialogue", _vqa_dialogue, "vqa", 4.0),
    ("vqa_dialogue_few", _few_object_dialogue, "vqa", 1.0),
    ("caption", scene.make, "caption", 0.3),
    ("text_scene_dialogue", text_only.make_scene_dialogue, "text", 0.3),
)

# The describing mix: the dialogue mix with twice its scene captions, for an LM that answers short questions well but
# names only part of a crowded scene (the code LM on exact codes: 0.62 caption attribute recall, zoo/TRAINING.md).
DESCRIBE_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, maker, task, w * 2 if name in ("caption", "caption_short") else w) for name, maker, task, w in DIALOGUE_MIX)

# The selection mix: the describing mix plus dialogues about confusable scenes (objects drawn from 2 colours x 3
# shapes), where most questions name an object by colour *and* shape beside objects that share one of the two; the
# code LM's "where" misses on exact codes were mostly such objects (zoo/TRAINING.md, "Confusable scenes").
CONFUSABLE_MIX: tuple[tuple[str, Maker, str, float], ...] = DESCRIBE_MIX + (
    ("vqa_dialogue_confusable", _confusable_dialogue, "vqa", 3.0),)

# The scene phase with hard negatives, for a code LM stage from scratch: the scenes mix plus confusable dialogues
# (two in five scene dialogues), so selection by colour *and* shape is trained from the first step; compared with the
# plain scenes mix on the same held-out check (zoo/TRAINING.md, "Confusable scenes").
SCENES_CONFUSABLE_MIX: tuple[tuple[str, Maker, str, float], ...] = SCENES_MIX + (
    ("vqa_dialogue_confusable", _confusable_dialogue, "vqa", 3.0),)

# The selection mix with captions that scan the nine cells (world/scene.py ``caption``, ``scan``): the same entries
# and weights, the scene captions (the evaluation suite's prompts) answered cell by cell.
_SCAN = {"caption": _scan_caption, "caption_short": _few_object_scan_caption}
CONFUSABLE_SCAN_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, _SCAN.get(name, maker), task, w) for name, maker, task, w in CONFUSABLE_MIX)

# The scan mix with twice its scene captions (two in five samples), for a frozen-vision stage that must keep the
# listing while the LM adapts to a fixed tower: with captions at a quarter of the weight, such a stage raised VQA and
# lost captions (zoo/TRAINING.md, "The tower drift").
SCAN_CAPTIONS_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, maker, task, w * 2 if name in ("caption", "caption_short") else w)
    for name, maker, task, w in CONFUSABLE_SCAN_MIX)

# The same with the scene captions listed by colour (world/scene.py ``colour_listing``) instead of by cell.
_COLOUR = {"caption": _colour_caption, "caption_short": _few_object_colour_caption}
COLOUR_CAPTIONS_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, _COLOUR.get(name, maker), task, w) for name, maker, task, w in SCAN_CAPTIONS_MIX)

# The scan-captions mix plus dialogues about charts, image sets and clips (every question type of those suites
# asked about one set of images), for an LM that answers them at blank-image level: in the mixes above they are
# single questions at a few percent of the samples (zoo/TRAINING.md, "Charts, image sets and clips as dialogues").
SCAN_SUITES_MIX: tuple[tuple[str, Maker, str, float], ...] = SCAN_CAPTIONS_MIX + (
    ("chart_dialogue", charts.make_dialogue, "qa", 1.5),
    ("multi_dialogue", image_sets.make_multi_dialogue, "qa", 1.5),
    ("video_dialogue", image_sets.make_video_dialogue, "qa", 1.5),
)


def _multi_scan_caption(rng: random.Random, suite: str, task: str) -> Sample:
    return image_sets.make_multi(rng, suite, "caption", scan=True)


# The suites mix with image sets at about a third of the samples, for an LM that reads one image well and several
# not at all (the cycle-2 target answered "one" to 37 of 39 "how many images" questions and described even the first
# image of a set wrongly): image-set captions in a fixed wording ("Image 2 has ..."), image-set dialogues and single
# questions up, the rest of the suites mix kept at its weights so scenes are not forgotten.
SCAN_MULTI_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, maker, task, {"multi_dialogue": 8.0, "multi_image": 2.0}.get(name, w))
    for name, maker, task, w in SCAN_SUITES_MIX if name != "multi_caption") + (
    ("multi_caption_scan", _multi_scan_caption, "caption", 6.0),)

# The image-sets mix plus dialogues about sets with an odd one out (about one sample in eight), for an LM whose odd-one-
# out answers see one sample in fifteen of the image-sets mix (zoo/TRAINING.md, "Image sets: counting images, and the
# odd one out against the set's look").
SCAN_MULTI_ODD_MIX: tuple[tuple[str, Maker, str, float], ...] = SCAN_MULTI_MIX + (
    ("multi_odd_dialogue", image_sets.make_odd_dialogue, "qa", 6.0),)

# The suites mix plus dialogues about sets built for counting (about one sample in ten), for an LM whose count hop
# tells the matching images apart but whose counting answers stay "one", the answer of most counting questions in the
# other mixes (zoo/TRAINING.md, "Counting on balanced sets").
SCAN_SUITES_COUNT_MIX: tuple[tuple[str, Maker, str, float], ...] = SCAN_SUITES_MIX + (
    ("multi_count_dialogue", image_sets.make_count_dialogue, "qa", 3.0),)

# The counting mix plus the odd-one-out dialogues (about one sample in twelve), for an LM that counts the images of a
# set but answers every odd-one-out question with one ordinal: the suites mix has no odd-one-out dialogues, and the
# image-sets mix that had them also pulled the one-image gates down (zoo/TRAINING.md, "Counting and the odd one out
# on the suites mix").
SCAN_SUITES_SETS_MIX: tuple[tuple[str, Maker, str, float], ...] = SCAN_SUITES_COUNT_MIX + (
    ("multi_odd_dialogue", image_sets.make_odd_dialogue, "qa", 3.0),)

# The counting mix plus as many chart dialogues again (charts about one sample in eight), for an LM learning to read
# charts from parts whose codes name what they show (--chart-words; zoo/TRAINING.md, "Chart reading words").
SCAN_SUITES_CHARTS_MIX: tuple[tuple[str, Maker, str, float], ...] = SCAN_SUITES_COUNT_MIX + (
    ("chart_dialogue_more", charts.make_dialogue, "qa", 2.0),)

# The suites mix with half of its samples asked the way API users ask: a line of text or the question before the
# image, or a system turn first (world/placed.py), for an LM that reads an image only at the start of the prompt
# (zoo/TRAINING.md, "Image sets: the LM reads the first image of a set").
SCAN_PLACED_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, placed.placed(maker), task, w) for name, maker, task, w in SCAN_SUITES_MIX)

# The image-sets mix with half of its samples placed as in SCAN_PLACED_MIX, for a stage that works on image sets
# (the second and later images of a set, read at about the blank level) without undoing what the placed mix taught.
SCAN_PLACED_MULTI_MIX: tuple[tuple[str, Maker, str, float], ...] = tuple(
    (name, placed.placed(maker), task, w) for name, maker, task, w in SCAN_MULTI_MIX)

MIXES = {"base": TRAIN_MIX, "dialogue": DIALOGUE_MIX, "lookup": LOOKUP_MIX, "scenes": SCENES_MIX,
         "describe": DESCRIBE_MIX, "confusable": CONFUSABLE_MIX, "scenes_confusable": SCENES_CONFUSABLE_MIX,
         "confusable_scan": CONFUSABLE_SCAN_MIX, "scan_captions": SCAN_CAPTIONS_MIX,
         "colour_captions": COLOUR_CAPTIONS_MIX, "scan_suites": SCAN_SUITES_MIX,
         "scan_multi": SCAN_MULTI_MIX, "scan_multi_odd": SCAN_MULTI_ODD_MIX, "scan_suites_count": SCAN_SUITES_COUNT_MIX,
         "scan_suites_sets": SCAN_SUITES_SETS_MIX, "scan_suites_charts": SCAN_SUITES_CHARTS_MIX,
         "scan_placed": SCAN_PLACED_MIX, "scan_placed_multi": SCAN_PLACED_MULTI_MIX}


def suite_names() -> list[str]:
    return list(SUITES)


def _rng(name: str, split: str, index: int, seed: int) -> random.Random:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return random.Random(f"specula-world/{seed}/{split}/{name}/{index}")


def generate(suite: str, split: str = "eval", index: int = 0, seed: int = 0) -> Sample:
    """The index-th sample of a named suite: deterministic in (suite, split, index, seed)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    s = SUITES[suite]
    return s.make(_rng(suite, split, index, seed), suite, s.task)


def generate_many(suite: str, n: int, split: str = "eval", start: int = 0, seed: int = 0) -> list[Sample]:
    return [generate(suite, split, i, seed) for i in range(start, start + n)]


def train_stream(seed: int = 0, start: int = 0, weights: dict[str, float] | None = None) -> Iterator[Sample]:
    """An endless deterministic stream over TRAIN_MIX; ``weights`` overrides entries' weights by name."""
    names = [m[0] for m in TRAIN_MIX]
    w = [(weights or {}).get(m[0], m[3]) for m in TRAIN_MIX]
    i = start
    while True:
        pick_rng = random.Random(f"specula-mix/{seed}/{i}")
        k = pick_rng.choices(range(len(names)), weights=w)[0]
        name, maker, task, _ = TRAIN_MIX[k]
        yield maker(_rng(name, "train", i, seed), name, task)
        i += 1
