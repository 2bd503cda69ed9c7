"""Drafters by config ``kind``: ``@register("ngram")`` on a class, ``create({"kind": "ngram", ...})`` to build one."""

from __future__ import annotations

from typing import Any, Callable

_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(kind: str):
    def deco(cls):
        if kind in _REGISTRY:
            raise ValueError(f"drafter kind {kind!r} registered twice")
        _REGISTRY[kind] = cls
        return cls

    return deco


def kinds() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create(config: dict, **resources) -> Any:
    """Build a drafter from ``{"kind": ..., <its options>}``; ``resources`` (target, tokenizer, device) are passed on."""
    _load_builtin()
    if "kind" not in config:
        raise ValueError("drafter config needs a 'kind'")
    kind = config["kind"]
    if kind not in _REGISTRY:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {', '.join(sorted(_REGISTRY))}")
    opts = {k: v for k, v in config.items() if k != "kind"}
    return _REGISTRY[kind](**opts, **resources)


def _load_builtin() -> None:
    from specula.drafters import eagle, msd, ngram, random_drafter, text_lm  # noqa: F401  (they register themselves)
    from specula.drafters import caption, ensemble, massv, pooled  # noqa: F401
    from specula.drafters import aasd, flash  # noqa: F401
