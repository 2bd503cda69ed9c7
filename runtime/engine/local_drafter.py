"""A drafter built beside a target loaded in this process (``specula generate``, the benches), its resources
filled in from that target."""

from __future__ import annotations


def check_kind(kind: str) -> None:
    """Refuse a drafter kind the registry does not know, naming the ones it does (and ``none``)."""
    from specula.drafters import kinds

    known = kinds()
    if kind not in known:
        raise ValueError(f"unknown drafter {kind!r}; known: {', '.join(known)}, or none for plain decoding")


def build_local_drafter(config: dict, target, tokenizer=None):
    """The drafter of ``{"kind": ..., <options>}`` (``label`` is only a name, ``adaptive`` and ``begin_after``
    engine settings (SpecEngine(adaptive=..., begin_after=...)): they are dropped).

    Options the config leaves out that the drafter takes by name (``registry.accepted_options``: its class's
    parameters and, through ``**options``, its base's) come from the target: ``target`` and ``tokenizer``
    (resources), ``vocab_size`` and ``image_token_id``. Only named parameters are filled, because some drafters
    reject unknown options.
    """
    from specula.drafters import create, registry

    opts = {k: v for k, v in config.items() if k not in ("label", "adaptive", "begin_after")}  # names / engine settings
    if "kind" not in opts:
        raise ValueError("drafter config needs a 'kind'")
    named = registry.accepted_options(opts["kind"])
    facts = {"target": target, "tokenizer": tokenizer, "vocab_size": target.info.vocab_size,
             "image_token_id": target.info.image_token_id}
    for name, value in facts.items():
        if name in named and name not in opts and value is not None:
            opts[name] = value
    return create(opts)
