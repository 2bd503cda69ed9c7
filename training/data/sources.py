"""Where a drafter recipe's prompts come from: the embedded world (``WorldSource``, what the shipped drafters were
trained on) or the user's conversation file (``ConversationSource``, issue 63). Both give the same thing for a split
and an index: the prompt encoded by the target's own processor and chat template (``EncodedPrompt``, Qwen's grid
included) and the data's own answer as tokens (``--answers data``); the recipes' answer caches
(``training/drafters/distill_data.py``) store only ids and come back here for the pixels.

Splits: ``train`` (every training prompt), ``text`` (those without images), ``vision`` (those with), ``eval`` (held
out). A conversation file holds one prompt per assistant turn (the turns before it); its last ``eval_records``
records are held out, so no held-out conversation is trained on.

    source = ConversationSource("data.jsonl", image_root="images/", processor=processor)
    p = source.get("train", 0)        # SourcePrompt: p.prompt.input_ids [L], p.prompt.pixel_values, p.answer_ids
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specula.runtime.engine.prompts import EncodedPrompt, encode_messages, encode_prompt, render

SPLITS = ("train", "text", "vision", "eval")


@dataclass(frozen=True)
class SourcePrompt:
    split: str
    index: int
    prompt: EncodedPrompt  # ids [L] with image tokens expanded, the pixels (and Qwen's grid)
    answer_ids: torch.Tensor  # [La] int64, the data's own answer as the chat template ends it (EOS / <|im_end|>)


def answer_tokens(processor, messages: list[dict], answer: str) -> torch.Tensor:
    """The tokens the chat template puts after the generation prompt for ``answer``: the template rendered with the
    answer minus the template rendered up to the generation prompt (so the turn's end token is included; when the
    template does not extend its own prefix, the answer's tokens), ending with the tokenizer's EOS, which the target
    emits to stop where the template writes nothing (LLaVA-1.5) or its turn end (Qwen2.5-VL's <|im_end|>)."""
    tok = processor.tokenizer
    head = render(processor, messages, add_generation_prompt=True)
    whole = render(processor, [*messages, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                   add_generation_prompt=False)
    if whole.startswith(head) and len(whole) > len(head):
        tail = whole[len(head):]
        ids = tok(tail, add_special_tokens=False)["input_ids"]
        stripped = tail.rstrip()  # templates end a turn with a newline the answer need not learn
        if stripped != tail:
            ids = tok(stripped, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(answer, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None and tok.eos_token_id not in ids[-1:]:
        ids = ids + [tok.eos_token_id]  # a template that ends an answer without EOS (LLaVA-1.5's): the model stops there
    return torch.tensor(ids, dtype=torch.long)


class WorldSource:
    """The embedded world's prompts (``world_prompts.world_sample``), rendered by the target's processor."""

    def __init__(self, processor, seed: int = 0):
        self.processor, self.seed = processor, seed
        self.key = {"source": "world", "seed": seed}

    def size(self, split: str) -> int | None:
        return None  # unbounded

    def get(self, split: str, index: int) -> SourcePrompt:
        from specula.training.data.world_prompts import world_sample

        s = world_sample(split, index, self.seed)
        prompt = encode_prompt(self.processor, s.prompt, s.images, s.system)
        tok = self.processor.tokenizer
        answer = torch.tensor(tok(s.response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return SourcePrompt(split, index, prompt, answer)


class ConversationSource:
    """A LLaVA-Instruct / ShareGPT4V conversation file (docs/training-data.md), checked whole before anything is
    trained (``load_conversations``: every bad record named in one error), one prompt per assistant turn."""

    def __init__(self, path: str | Path, image_root: str | Path | None, processor, *, eval_records: int | None = None,
                 max_tokens: int | None = None, tokens_per_image: int = 0, progress: bool = True):
        from specula.training.data.checks import load_conversations
        from specula.training.data.messages import exchanges
        from specula.zoo.store import sha256

        self.processor = processor
        convs = load_conversations(path, image_root, check_images=True, tokenizer=processor.tokenizer,
                                   max_tokens=max_tokens, tokens_per_image=tokens_per_image, progress=progress)
        if not convs:
            raise ValueError(f"{path}: no conversation with an answer to train on")
        n_eval = min(32, max(1, len(convs) // 20)) if eval_records is None else eval_records
        if n_eval >= len(convs):
            raise ValueError(f"{path}: {len(convs)} conversations, {n_eval} held out for evaluation: nothing left to "
                             "train on")
        self.convs = convs
        cut = len(convs) - n_eval
        rows = [(c, ex) for c in range(len(convs)) for ex in exchanges(convs[c])]
        self.splits = {"train": [r for r in rows if r[0] < cut], "eval": [r for r in rows if r[0] >= cut]}
        self.splits["text"] = [r for r in self.splits["train"] if r[1].n_images == 0]
        self.splits["vision"] = [r for r in self.splits["train"] if r[1].n_images > 0]
        self.key = {"source": "conversations", "file_sha256": sha256(Path(path)), "eval_records": n_eval}

    def size(self, split: str) -> int:
        return len(self._rows(split))

    def _rows(self, split: str) -> list:
        if split not in self.splits:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.splits[split]

    def get(self, split: str, index: int) -> SourcePrompt:
        from specula.training.data.messages import load_images

        rows = self._rows(split)
        if not 0 <= index < len(rows):
            raise IndexError(f"{split} prompt {index}: the file has {len(rows)} {split} prompts")
        c, ex = rows[index]
        images = load_images(self.convs[c])[: ex.n_images]
        prompt = encode_messages(self.processor, ex.messages, images)
        return SourcePrompt(split, index, prompt, answer_tokens(self.processor, ex.messages, ex.answer))
