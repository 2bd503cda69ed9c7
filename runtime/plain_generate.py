"""``specula generate``: answer a question about images with plain target decoding (no drafter yet)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError


def load_images(paths: list[str]) -> list[Image.Image]:
    images = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"image {p!r} does not exist")
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"image {p!r} cannot be read: {e}") from None
    return images


def main(args) -> int:
    from transformers import LlavaForConditionalGeneration

    from specula.targets.processor import load_processor
    from specula.runtime.prompts import encode_prompt
    from specula.zoo.paths import resolve

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    images = load_images(args.image)
    path = resolve(args.model)
    processor = load_processor(path)
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).to(args.device).eval()
    ids, pix = encode_prompt(processor, "<image>" * len(images) + args.question, images)
    inputs = {"input_ids": ids[None].to(args.device)}
    if pix is not None:
        inputs["pixel_values"] = pix.to(args.device)
    tok = processor.tokenizer
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=args.max_tokens, do_sample=args.temperature > 0,
            temperature=args.temperature if args.temperature > 0 else None,
            top_k=None, top_p=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
    dt = time.perf_counter() - t0
    new = out[0, inputs["input_ids"].shape[1]:]
    answer = tok.decode(new, skip_special_tokens=True)
    n = int(new.numel())
    record = {"answer": answer, "new_tokens": n, "seconds": round(dt, 4), "tokens_per_s": round(n / dt, 2),
              "model": str(path), "prompt_tokens": int(inputs["input_ids"].shape[1])}
    if args.json:
        print(json.dumps(record))
    else:
        print(answer)
        print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, prompt {record['prompt_tokens']} tokens, model {path}]")
    return 0
