"""Distillation data for drafter recipes: the target's own greedy answers to world prompts, cached on disk.

A drafter must predict what *this* target says, so its training answers come from the target itself (sequence-level
distillation), not from the world's reference responses. Each answer is stored with the full prompt ids (image
tokens expanded) and the world index it came from; images are not stored (a world sample is a pure function of its
index), ``pixels`` re-renders them when a recipe needs the target's features again.

Layout of a data folder (written by ``make_answers``, resumable):

    meta.json                     what defines the answers (recipe settings + sha256 of the target's weights);
                                  a rerun that differs is refused
    train-00000000.safetensors    chunks of ``chunk`` answers to ``train_stream(seed, start + i)`` prompts,
    ...                           written whole then renamed: a rerun skips the chunks it has (``split="text"`` /
                                  ``"vision"``: text-00000000... / vision-00000000..., see ``world_sample``)
    eval.safetensors              answers to ``eval_samples`` prompts of the evaluation suites (``eval_sample``)

    key = {"target_sha256": target_fingerprint(target_dir), "max_new_tokens": 96, "seed": 0, "start": 2_000_000}
    folder = make_answers(Path("runs/eagle/data"), target, processor, key=key, n=20_000, eval_n=128)
    train = load_answers(folder, "train", 20_000)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specula.training.data.world_prompts import EVAL_OFFSET, EVAL_SUITES, TRAIN_SPLITS, world_sample  # noqa: F401

DATA_FORMAT = "specula-distill-answers/1"


@dataclass(frozen=True)
class Answer:
    split: str  # "train" / "text" / "vision" (world_sample) or "eval" (the evaluation suites)
    index: int
    prompt: torch.Tensor  # [Lp] int64, image tokens expanded
    response: torch.Tensor  # [Lr] int64, the target's greedy answer (EOS included when reached)


def encode(processor, sample) -> tuple[torch.Tensor, torch.Tensor | None]:
    """World sample -> (input_ids [L] with image tokens expanded, pixel_values [N_img, 3, S, S] or None)."""
    from specula.world.tokenizer import format_turns

    text = format_turns(sample.prompt, system=sample.system)
    if sample.images:
        enc = processor(text=[text], images=list(sample.images), return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"][0], enc["pixel_values"]
    return processor.tokenizer([text], return_tensors="pt", add_special_tokens=False)["input_ids"][0], None


def prompt_of(processor, answer: Answer, seed: int, source=None):
    """Re-render an answer's prompt from its source (default: the world): an ``EncodedPrompt`` (pixels, Qwen's grid).
    Checks the prompt still matches the stored ids."""
    from specula.training.data.sources import WorldSource

    src = source if source is not None else WorldSource(processor, seed)
    enc = src.get(answer.split, answer.index).prompt
    if not torch.equal(enc.input_ids, answer.prompt):
        raise ValueError(f"{answer.split} prompt {answer.index} no longer matches its source ({src.key})")
    return enc


def pixels(processor, answer: Answer, seed: int, source=None) -> torch.Tensor | None:
    """Re-render an answer's images: pixel_values [N_img, 3, S, S] (Qwen2.5-VL: patches) or None."""
    return prompt_of(processor, answer, seed, source).pixel_values


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's weight files: cached answers belong to exactly these weights."""
    from specula.zoo.store import weights_fingerprint

    return weights_fingerprint(target_dir)


@torch.no_grad()
def greedy_answers(target, requests, max_new_tokens: int, eos: set[int]) -> list[torch.Tensor]:
    """Batched greedy answers of a ``specula.targets`` Target to PrefillRequests: one [Lr] int64 per request."""
    from specula.targets import Accept

    out = target.prefill(requests)
    ids = list(out.request_ids)
    toks: dict[str, list[int]] = {r: [] for r in ids}

    def take(rids, logits):  # logits [B, V] fp32
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(rids, nxt):
            toks[r].append(t)
        target.commit([Accept(r, (), t) for r, t in zip(rids, nxt)])

    try:
        take(ids, out.logits)
        active = ids
        while True:
            done = [r for r in active if toks[r][-1] in eos or len(toks[r]) >= max_new_tokens]
            if done:
                target.release(done)
            active = [r for r in active if r not in done]
            if not active:
                break
            take(active, target.decode_step(active).logits[:, 0])
    finally:
        target.release([r for r in ids if r in target.live_ids])
    return [torch.tensor(toks[r], dtype=torch.long) for r in ids]


def cut_at_image_token(response: torch.Tensor, image_token_id: int | None) -> torch.Tensor:
    """``response`` [Lr] up to its first image placeholder, if any: a target that emits one (an undertrained or a
    sampled one) has written a token no image stands behind, which every training forward would read as an image
    slot with no features."""
    if image_token_id is None:
        return response
    hits = (response == image_token_id).nonzero()
    return response[: int(hits[0, 0])] if len(hits) else response


def _answer(target, processor, split: str, indices: list[int], seed: int, max_new_tokens: int,
            gen_batch: int, source=None, answers: str = "target") -> list[Answer]:
    from specula.training.data.sources import WorldSource

    src = source if source is not None else WorldSource(processor, seed)
    got = [src.get(split, i) for i in indices]
    if answers == "data":  # the file's own answers, as the chat template ends them
        return [Answer(split, i, g.prompt.input_ids, g.answer_ids[:max_new_tokens]) for i, g in zip(indices, got)]
    eos = set(target.info.eos_token_ids) | {processor.tokenizer.eos_token_id}
    order = sorted(range(len(got)), key=lambda j: len(got[j].prompt.input_ids))  # similar lengths batch together
    out: list[Answer | None] = [None] * len(got)
    for g in range(0, len(order), gen_batch):
        group = order[g:g + gen_batch]
        reqs = [got[j].prompt.prefill(f"{split}-{indices[j]}") for j in group]
        for j, resp in zip(group, greedy_answers(target, reqs, max_new_tokens, eos)):
            out[j] = Answer(split, indices[j], got[j].prompt.input_ids,
                            cut_at_image_token(resp, target.info.image_token_id))
    return out


def write_answers(path: Path, answers: list[Answer], meta: dict) -> None:
    tensors = {
        "index": torch.tensor([a.index for a in answers], dtype=torch.long),
        "prompt": torch.cat([a.prompt for a in answers]).to(torch.int32),
        "prompt_len": torch.tensor([len(a.prompt) for a in answers], dtype=torch.long),
        "response": torch.cat([a.response for a in answers]).to(torch.int32),
        "response_len": torch.tensor([len(a.response) for a in answers], dtype=torch.long),
    }
    split = answers[0].split if answers else "train"
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": DATA_FORMAT, "split": split,
                                      **{k: str(v) for k, v in meta.items()}})
    tmp.replace(path)


def read_answers(path: Path) -> list[Answer]:
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != DATA_FORMAT:
        raise ValueError(f"{path}: not a {DATA_FORMAT} file")
    t = load_file(path)
    out, p0, r0 = [], 0, 0
    for i, lp, lr in zip(t["index"].tolist(), t["prompt_len"].tolist(), t["response_len"].tolist()):
        out.append(Answer(meta["split"], i, t["prompt"][p0:p0 + lp].long(), t["response"][r0:r0 + lr].long()))
        p0, r0 = p0 + lp, r0 + lr
    return out


def same_data(old: dict, new: dict) -> bool:
    """Whether cached data recorded with key ``old`` serves a run asking for ``new``. A key holding the target's
    weights fingerprint (``target_sha256``) names the target by it, not by the folder it was loaded from
    (``target``): the same target copied elsewhere (a candidate zoo, a promoted zoo) reuses its answers."""
    def strip(key: dict) -> dict:
        return {k: v for k, v in key.items() if k != "target"} if "target_sha256" in key else key
    return strip(old) == strip(new)


def make_answers(folder: Path, target, processor, *, key: dict, n: int, eval_n: int = 0, start: int = 0,
                 seed: int = 0, max_new_tokens: int = 96, chunk: int = 64, gen_batch: int = 16,
                 desc: str = "target answers", log=print, split: str = "train", source=None,
                 answers: str = "target") -> Path:
    """Generate (or finish generating) ``n`` training answers (prompts ``start .. start + n - 1`` of ``split``, see
    ``world_sample``; files ``<split>-<first>.safetensors``) and ``eval_n`` held-out ones into ``folder``; ``key``
    (what defines the answers, with the target's fingerprint) is recorded in meta.json and must match on a rerun.
    Several splits may share a folder (and its eval answers). ``source``: where the prompts come from
    (``training/data/sources.py``; default the world); ``answers``: "target" (its greedy answers, self-distillation)
    or "data" (the source's own answers)."""
    if split not in TRAIN_SPLITS:
        raise ValueError(f"split must be one of {TRAIN_SPLITS}, got {split!r}")
    if answers not in ("target", "data"):
        raise ValueError(f"answers must be 'target' or 'data', got {answers!r}")
    if source is not None:
        for part, want in ((split, start + n), ("eval", eval_n)):
            have = source.size(part)
            if have is not None and want > have:
                raise ValueError(f"{want} {part} prompts asked for, the data has {have} (ask fewer: --samples)")
        key = {**key, **source.key} if source.key.get("source") != "world" else key
    if answers == "data":
        key = {**key, "answers": "data"}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    full_key = {**key, "start": start, "seed": seed, "max_new_tokens": max_new_tokens, "chunk": chunk}
    meta_path = folder / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if not same_data(old, full_key):
            raise ValueError(f"{folder} holds answers made with {old}; this run asks for {full_key}: use another "
                             f"folder")
    else:
        meta_path.write_text(json.dumps(full_key, indent=1) + "\n")
    if eval_n and (not (folder / "eval.safetensors").exists()
                   or len(read_answers(folder / "eval.safetensors")) < eval_n):
        write_answers(folder / "eval.safetensors",
                      _answer(target, processor, "eval", list(range(eval_n)), seed, max_new_tokens, gen_batch,
                              source, answers), full_key)

    def complete(s: int) -> bool:  # a shorter last chunk of a smaller earlier run is made again
        f = folder / f"{split}-{s:08d}.safetensors"
        if not f.exists():
            return False
        with safe_open(f, "pt") as h:
            return h.get_slice("index").get_shape()[0] >= min(chunk, n - s)

    todo = [s for s in range(0, n, chunk) if not complete(s)]
    done = n - sum(min(chunk, n - s) for s in todo)
    if done:
        log(f"data: {done} of {n} {split} target answers already in {folder}")
    bar = tqdm(total=n, initial=done, unit="sample", desc=desc, mininterval=5.0)
    for s in todo:
        m = min(chunk, n - s)
        made = _answer(target, processor, split, list(range(start + s, start + s + m)), seed, max_new_tokens,
                       gen_batch, source, answers)
        write_answers(folder / f"{split}-{s:08d}.safetensors", made, full_key)
        bar.update(m)
    bar.close()
    return folder


def load_answers(folder: Path, split: str, n: int | None = None) -> list[Answer]:
    """The first ``n`` answers of a split (all when None), in index order."""
    folder = Path(folder)
    if split == "eval":
        out = read_answers(folder / "eval.safetensors") if (folder / "eval.safetensors").exists() else []
    else:
        out = [a for f in sorted(folder.glob(f"{split}-*.safetensors")) for a in read_answers(f)]
    if n is not None:
        if len(out) < n:
            raise ValueError(f"{folder} holds {len(out)} {split} answers, {n} asked for")
        out = out[:n]
    return out
