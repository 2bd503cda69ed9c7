"""The one record the world hands out: images, a user prompt, the reference response, and what evaluation needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

IMAGE_SIZE = 168  # pixels per side; the target's vision tower sees 168 px
PATCH = 14  # vision patch size -> a 12 x 12 grid of 144 visual tokens
GRID = IMAGE_SIZE // PATCH
IMAGE_MARK = "<image>"  # one per image in the prompt, in order


@dataclass(frozen=True)
class Sample:
    """One world example.

    ``prompt`` is the user turn with one ``<image>`` mark per image. ``response`` is the reference assistant turn.
    ``answer`` is the short exact-match answer where the task has one (VQA, chart, OCR, multi-image, video and the
    first sentence of reasoning answers). ``n_choices`` is how many answers the question type admits (chance level
    = 1 / n_choices for a balanced question). ``attributes`` are words a good caption must name. ``patch_words``
    holds, per image, the words describing the object under each of the GRID*GRID patches (empty tuple for
    background); training uses it as a dense auxiliary signal. ``followups`` (training only) are further user /
    assistant turns about the same images after the first, so one image's visual tokens serve many answers.
    ``system`` is the text of a system turn in front of the user turn, if any.
    """

    suite: str
    kind: str
    images: tuple[Image.Image, ...]
    prompt: str
    response: str
    answer: str | None = None
    n_choices: int | None = None
    attributes: tuple[str, ...] = ()
    patch_words: tuple[tuple[tuple[str, ...], ...], ...] = field(default=(), repr=False)
    followups: tuple[tuple[str, str], ...] = ()  # training dialogues: more (question, answer) turns on the same images
    system: str = ""  # a system turn before the user turn ("" = none; world/placed.py)

    def __post_init__(self) -> None:
        if self.prompt.count(IMAGE_MARK) != len(self.images):
            raise ValueError(
                f"sample {self.suite}/{self.kind}: prompt has {self.prompt.count(IMAGE_MARK)} image marks "
                f"but {len(self.images)} images"
            )
