"""``specula bench target``: what the target costs on this machine, as JSON + markdown, ratios from one run."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def world_prompts(target, processor, n_text_suffix: str = "What colour is the star? Answer with one word."):
    """One real prompt: the bundled sample image and a world question, through the checkpoint's own chat template
    and processor (runtime/engine/prompts.py), so LLaVA-1.5 and Qwen2.5-VL get their own formats."""
    from PIL import Image

    import specula.world
    from specula.runtime.engine.prompts import encode_prompt

    sample = Path(specula.world.__file__).parent / "assets" / "sample.png"
    prompt = encode_prompt(processor, "<image>" + n_text_suffix, [Image.open(sample).convert("RGB")])
    return [prompt.prefill("bench-0")]


def main(args) -> int:
    from specula.targets import load_target
    from specula.runtime.bench.target_timing import bench_target, render_markdown
    from specula.targets.processor import load_processor, processor_kind
    from specula.zoo.store import resolve

    if args.max_gamma < 1:
        raise ValueError("--max-gamma must be at least 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    path = resolve(args.model)
    target = load_target(str(path), device=args.device)
    prompts_fn = None
    if processor_kind(path) is not None:  # a checkpoint with its processor: the real prompt, else synthetic ones
        processor = load_processor(path)
        prompts_fn = lambda: world_prompts(target, processor)  # noqa: E731
    result = bench_target(target, prompts_fn=prompts_fn, gammas=range(1, args.max_gamma + 1), repeats=args.repeats)
    result["machine"] = {"cpu_count": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads(),
                         "torch": torch.__version__, "python": platform.python_version(), "device": args.device}
    result["model"] = str(path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_target.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render_markdown(result)
    (out / "bench_target.md").write_text(md)
    print(md)
    print(f"wrote {out / 'bench_target.json'} and {out / 'bench_target.md'}")
    return 0
