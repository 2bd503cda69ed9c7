"""The embedded model family: its configs, training recipes, shipped weights and quality gates.

Weights live under ``zoo/weights/<name>/`` (safetensors, fp16 storage) with ``zoo/weights/manifest.json``
(sha256 per file). ``specula zoo build`` regenerates everything deterministically from seeds; ``specula zoo list``
shows what is shipped; ``specula zoo eval`` prints the quality gates.
"""
