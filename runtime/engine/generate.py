"""``specula generate``: answer a question about images with plain target decoding through the engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

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
    from specula.runtime.engine.loop import GenerationRequest, SpecEngine
    from specula.runtime.engine.prompts import encode_prompt
    from specula.runtime.core.sampling import SamplingParams
    from specula.targets import load_target
    from specula.targets.processor import load_processor
    from specula.zoo.store import resolve

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    images = load_images(args.image)
    path = resolve(args.model)
    processor = load_processor(path)
    tok = processor.tokenizer
    target = load_target(str(path), device=args.device)
    ids, pix = encode_prompt(processor, "<image>" * len(images) + args.question, images)
    engine = SpecEngine(target, None, eos_token_ids=[tok.eos_token_id],
                        decode=lambda t: tok.decode(t, skip_special_tokens=True))
    t0 = time.perf_counter()
    res = engine.generate([GenerationRequest("cli", ids, pix, params)])["cli"]
    dt = time.perf_counter() - t0
    n = len(res.tokens)
    prefill = res.metrics.time["prefill"]
    decode_s = max(dt - prefill, 1e-9)
    record = {"answer": res.text, "new_tokens": n, "seconds": round(dt, 4), "tokens_per_s": round(n / dt, 2),
              "prefill_s": round(prefill, 4), "decode_tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 else None,
              "model": str(path), "prompt_tokens": int(ids.numel()), "finish_reason": res.finish_reason}
    if args.json:
        print(json.dumps(record))
    else:
        print(res.text)
        rate = f", decode {record['decode_tokens_per_s']} tokens/s" if n > 1 else ""
        print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s (prefill {prefill * 1e3:.0f} ms of "
              f"{record['prompt_tokens']} prompt tokens{rate}); model {path}]")
    return 0
