"""Specula: lossless speculative decoding for vision-language models.

Subpackages live in top-level folders of the repository and are installed under this namespace:
``specula.targets`` (targets/), ``specula.drafters`` (drafters/), ``specula.runtime`` (runtime/),
``specula.world`` (world/), ``specula.zoo`` (zoo/), ``specula.protos`` (protos/).
"""

__version__ = "0.1.0"
