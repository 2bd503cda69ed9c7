"""What every benchmark shares, light to import (no torch): the evaluation suites in report order, and where their
prompts start in each suite's evaluation split (the same prompts in every bench, past any a test or a recipe uses)."""

EVAL_SUITES = ("caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text")
BENCH_OFFSET = 30_000
