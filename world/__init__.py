"""The embedded multimodal world: procedural, seeded scenes, charts, signs, multi-image sets, frame
sequences and text-only conversations, with the tasks and evaluation suites Specula trains and measures on.

    >>> from specula.world import generate
    >>> s = generate("vqa", split="eval", index=0)
    >>> s.prompt, s.response
"""

from specula.world.sample import Sample, IMAGE_SIZE, PATCH, GRID
from specula.world.suites import SUITES, TRAIN_MIX, generate, generate_many, suite_names

__all__ = ["Sample", "IMAGE_SIZE", "PATCH", "GRID", "SUITES", "TRAIN_MIX", "generate", "generate_many", "suite_names"]
