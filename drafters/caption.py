"""``caption``: caption drafting (IbED sec. 5.2): a lightweight captioner captions each image once per request, and
a text-only drafter drafts with the captions in place of the images.

The captioner is a ``massv`` model in caption mode (``MassvModel.caption``: the caption instruction the model was
trained on, greedy, at most ``caption_max_tokens``), by default the drafting model itself; the drafting LM may also
be a plain text LM (``path: "text_lm"``) with ``captioner: "massv"``. Captions are made in ``begin`` (one batched
decode for all images of the call) and their time is booked as "caption" in the request's time split
(``pop_begin_times``), apart from "draft". The ``ensemble`` drafter with one caption member.

    drafter = create({"kind": "caption", "path": "text_lm", "captioner": "massv"}, target=target)
"""

from __future__ import annotations

from specula.drafters.ensemble import EnsembleDrafter
from specula.drafters.registration import register


@register("caption")
class CaptionDrafter(EnsembleDrafter):
    """Options: ``captioner`` (path or ``MassvModel``, default the drafting model), ``caption_max_tokens``, and
    those of ``massv`` (``path`` may be a plain Llama directory here)."""

    KIND = "caption"
    DEFAULT_MEMBERS = ("caption",)

    def __init__(self, target=None, tokenizer=None, vocab_size: int | None = None, image_token_id: int | None = None,
                 device: str | None = None, **options):
        fixed = {"members", "weights", "grid"} & set(options)
        if fixed:
            raise ValueError(f"caption: unknown options {sorted(fixed)} (caption has one caption member)")
        super().__init__(**options, target=target, tokenizer=tokenizer, vocab_size=vocab_size,
                         image_token_id=image_token_id, device=device)
