"""What every ``specula train`` recipe (eagle, msd, flash, aasd, massv, text_lm) does the same way: the learning-rate
schedule, the seeded epoch order that makes a resumed run see the same samples, the resumable chunked data files,
the atomic checkpoint and the wall-clock cadence of evaluations and checkpoints.

One copy, so a fix to resuming or checkpointing reaches every recipe."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def warmup_cosine(k: int, warmup: int, total: int, peak: float) -> float:
    """Learning rate after k samples: linear warmup over ``warmup`` samples, then cosine decay to 5% of ``peak`` at
    ``total``."""
    if k < warmup:
        return peak * max(k, 1) / warmup
    frac = min(1.0, (k - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def epoch_order(j: int, n: int, seed: int, cache: dict) -> int:
    """Data index of the j-th training sample: epochs in a seeded order (a pure function of j, so a resumed run sees
    the same batches; ``cache`` holds the current epoch's permutation)."""
    epoch = j // n
    if epoch not in cache:
        cache.clear()
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return cache[epoch][j % n]


def chunks_to_make(folder: Path, prefix: str, total: int, chunk: int) -> tuple[list[int], int]:
    """The data files ``<prefix>-<start:08d>.safetensors`` of ``total`` samples in chunks of ``chunk``: the starts of
    those missing or shorter than they should be (a shorter last chunk of a smaller earlier run is made again), and
    how many samples the complete ones already hold."""

    def complete(s: int) -> bool:
        f = folder / f"{prefix}-{s:08d}.safetensors"
        if not f.exists():
            return False
        with safe_open(f, "pt") as h:
            return h.get_slice("index").get_shape()[0] >= min(chunk, total - s)

    todo = [s for s in range(0, total, chunk) if not complete(s)]
    return todo, total - sum(min(chunk, total - s) for s in todo)


def save_checkpoint(ckpt: Path, weights_file: str, weights: dict[str, torch.Tensor], optimizer, state: dict,
                    texts: dict[str, str] | None = None) -> None:
    """Writes the checkpoint into ``<ckpt>.tmp`` (weights, ``optimizer.pt``, the ``texts`` files, ``state.json``),
    then moves each file into ``ckpt``: an interrupted save never leaves a half-written file under ``ckpt``."""
    tmp = ckpt.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(weights, tmp / weights_file)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    for name, text in (texts or {}).items():
        (tmp / name).write_text(text)
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    ckpt.mkdir(exist_ok=True)
    for f in tmp.iterdir():
        f.replace(ckpt / f.name)
    tmp.rmdir()


class Cadence:
    """The wall clock of a training loop: adds the time between ticks to ``state["elapsed_s"]`` (evaluations not
    counted), evaluates every ``eval_every_s`` and checkpoints every ``ckpt_every_s`` seconds."""

    def __init__(self, state: dict, eval_every_s: float, ckpt_every_s: float):
        self.state, self.eval_every_s, self.ckpt_every_s = state, eval_every_s, ckpt_every_s
        self.t_last = self.last_ckpt = self.last_eval = time.time()

    def tick(self, run_eval: Callable[[], None], save: Callable[[], None]) -> None:
        now = time.time()
        self.state["elapsed_s"] += now - self.t_last
        self.t_last = now
        if now - self.last_eval > self.eval_every_s:
            run_eval()
            self.last_eval = self.t_last = time.time()
        if now - self.last_ckpt > self.ckpt_every_s:
            save()
            self.last_ckpt = time.time()


def check_data_fields(cfg) -> None:
    """The data fields every recipe config shares (``data_file``, ``image_root``, ``answers``)."""
    name = type(cfg).__name__
    if cfg.answers not in ("target", "data"):
        raise ValueError(f"{name}.answers must be 'target' or 'data', got {cfg.answers!r}")
    if cfg.answers == "data" and not cfg.data_file:
        raise ValueError(f"{name}.answers = 'data' needs a data_file (--data FILE): the world's answers are not "
                         "the target's")
    if cfg.image_root and not cfg.data_file:
        raise ValueError(f"{name}.image_root is for a data_file (--data FILE)")


def recipe_processor(cfg, target_dir: Path):
    """The processor a recipe renders prompts with: ``cfg.tokenizer_dir`` when set, else the target's own."""
    from specula.targets.processor import load_processor

    return load_processor(cfg.tokenizer_dir or target_dir)


def data_source(cfg, processor, tokens_per_image: int = 0, log=print):
    """Where a recipe's prompts come from: the user's conversation file (``cfg.data_file``, every record checked
    before anything is trained) or, without one, the embedded world (``training/data/sources.py``)."""
    from specula.training.data.sources import ConversationSource, WorldSource

    if not cfg.data_file:
        return WorldSource(processor, cfg.seed)
    src = ConversationSource(cfg.data_file, cfg.image_root or None, processor, tokens_per_image=tokens_per_image)
    log(f"data: {cfg.data_file}: {src.size('train')} training prompts ({src.size('text')} text-only, "
        f"{src.size('vision')} with images), {src.size('eval')} held out")
    return src


def data_count(source, split: str, asked: int, log=print) -> int:
    """How many prompts of ``split`` a recipe uses: ``asked``, or all of a conversation file's when it holds
    fewer (the world has no end)."""
    have = source.size(split)
    if have is None or asked <= have:
        return asked
    log(f"data: {have} {split} prompts in the file (asked for {asked}): using all {have}")
    return have


def data_start(cfg) -> int:
    """The first prompt index of a recipe's training split: the recipe's world offset, 0 in a conversation file."""
    return cfg.data_start if not cfg.data_file else 0
