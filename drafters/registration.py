"""Where drafter classes register themselves by config ``kind`` (``@register("ngram")``); a leaf module, so that every
drafter can import it while ``registry.py`` (the lookup, which loads the built-in drafters) imports them all."""

from __future__ import annotations

from typing import Any, Callable

REGISTERED: dict[str, Callable[..., Any]] = {}


def register(kind: str):
    def deco(cls):
        if kind in REGISTERED:
            raise ValueError(f"drafter kind {kind!r} registered twice")
        REGISTERED[kind] = cls
        return cls

    return deco
