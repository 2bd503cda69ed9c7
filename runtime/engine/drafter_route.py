"""Which drafter a request drafts with when it names none: by its kind (config ``drafter.text_only``).

A request that brings no image or video (no pixels, no visual features) drafts with the ``text_only`` drafter; one
with images, or one that names a drafter itself, is left as it is (its choice, else the default). Set on the
``GenerationRequest`` before it reaches the engine, so everything downstream sees an ordinary named choice: a
``MultiDrafter`` routes on it in process, a data-plane ``Begin`` carries it to a drafter replica, and the answer's
metrics name the drafter that drafted. Lossless either way: the drafter only changes what is proposed.
"""

from __future__ import annotations

from dataclasses import replace

from specula.runtime.engine.loop import GenerationRequest


def has_images(request: GenerationRequest) -> bool:
    """Whether the request carries any image or video (as pixels or as precomputed features)."""
    return request.pixel_values is not None or request.visual is not None


def route(request: GenerationRequest, text_only: str | None) -> GenerationRequest:
    """``request`` with ``drafter`` set to ``text_only`` when it has no images and named no drafter."""
    if text_only is None or request.drafter is not None or has_images(request):
        return request
    return replace(request, drafter=text_only)
