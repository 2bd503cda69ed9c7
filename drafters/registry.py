"""Drafters by config ``kind``: ``@register("ngram")`` on a class (``registration.py``), ``create({"kind": "ngram",
...})`` to build one; the lookups here load the built-in drafters first."""

from __future__ import annotations

import inspect
from typing import Any

from specula.drafters.registration import REGISTERED as _REGISTRY, register  # noqa: F401  (re-exported)


# the built-in drafters: kind -> the module of specula.drafters that registers it (imported on first use only, so
# naming the kinds, e.g. to check a config, costs no model code)
BUILTIN: dict[str, str] = {
    "aasd": "aasd", "caption": "caption", "eagle": "eagle", "ensemble": "ensemble", "flash": "flash",
    "massv": "massv", "msd": "msd", "ngram": "ngram", "pooled": "pooled", "random": "random_drafter",
    "text_lm": "text_lm",
}


def kinds() -> list[str]:
    """Every drafter kind: the built-in ones and any registered since; imports no drafter module."""
    return sorted(set(BUILTIN) | set(_REGISTRY))


def accepted_options(kind: str) -> frozenset[str]:
    """The option names drafter ``kind`` takes by keyword: its ``__init__``'s named parameters and, while an
    ``__init__`` passes ``**options`` on to its base class, the base's (a FLASH drafter takes EAGLE's ``target``).
    Empty for an unknown kind. Callers fill resources (``target``, ``vocab_size``, ``device``) only where named,
    because some drafters reject options they do not know."""
    _load_builtin()
    cls = _REGISTRY.get(kind)
    names: set[str] = set()
    for klass in (cls.__mro__ if isinstance(cls, type) else ()):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return frozenset(names)


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
    # the modules of BUILTIN (tests/drafters/test_registry_kinds.py keeps the two in step)
    from specula.drafters import eagle, msd, ngram, random_drafter, text_lm  # noqa: F401  (they register themselves)
    from specula.drafters import caption, ensemble, massv, pooled  # noqa: F401
    from specula.drafters import aasd, flash  # noqa: F401
