"""The embedded world's training and evaluation prompts, by split and index (a world sample is a pure function of
its index, so a recipe stores the index and re-renders the prompt when it needs it again)."""

from __future__ import annotations

EVAL_SUITES = ("caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text")
EVAL_OFFSET = 20_000  # eval prompts are the evaluation suites' samples from this index on
TRAIN_SPLITS = ("train", "text", "vision")  # what make_answers can draw training prompts from (world_sample)


def world_sample(split: str, index: int, seed: int):
    """The world prompt behind an answer: "train" the index-th sample of the world's training mix (``train_stream``);
    "text" the text-only conversations of that mix (the ``text`` suite's training split); "vision" the training mix
    without them (every prompt has images); "eval" the evaluation suites, round robin."""
    from specula.world.suites import generate, train_stream

    if split == "train":
        return next(train_stream(seed=seed, start=index))
    if split == "text":
        return generate("text", "train", index, seed)
    if split == "vision":
        return next(train_stream(seed=seed, start=index, weights={"text": 0.0}))
    if split == "eval":
        return generate(EVAL_SUITES[index % len(EVAL_SUITES)], "eval", EVAL_OFFSET + index, seed)
    raise ValueError(f"split must be one of {TRAIN_SPLITS + ('eval',)}, got {split!r}")
