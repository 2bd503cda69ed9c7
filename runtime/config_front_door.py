"""The command-line door to a config, as vLLM users type it: ``specula serve MODEL_DIR --drafter KIND|DIR --gamma N
--speculative-config JSON``. Each flag overrides one part of the config (``--config`` or the defaults) before it is
validated, so a flag can never produce a config that a YAML file could not.

    specula serve /models/llava-1.5-7b                                   # ngram drafts (the config's default)
    specula serve /models/llava-1.5-7b --drafter runs/eagle-llava --gamma 5
    specula serve /models/qwen2.5-vl-7b --speculative-config '{"method": "draft_model", "model": "/models/qwen2.5-0.5b", "num_speculative_tokens": 4}'

``--drafter`` takes a trained drafter's directory (its ``specula.json`` names the kind), a shipped zoo entry (the
embedded target's drafters: ``flash``, ``eagle``, ...) or a kind that needs no weights (``ngram``).
``--speculative-config`` takes vLLM's keys (``method``, ``model``, ``num_speculative_tokens``, ``prompt_lookup_max``)
and any ``drafter.*`` field of the config (``overlap``, ``predraft``, ...); unknown keys are errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specula.runtime.config import ConfigError, DrafterConfig

# vLLM's speculative ``method`` names -> Specula drafter kinds
METHODS = {"ngram": "ngram", "draft_model": "text_lm", "eagle": "eagle", "eagle3": "eagle"}
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max"}


def drafter_from_ref(ref: str, flag: str = "--drafter") -> dict[str, Any]:
    """``{"kind": ..., "options": {...}}`` for a drafter directory, a shipped entry or a weightless kind."""
    from specula.drafters.registry import kinds
    from specula.zoo.store import drafter_record, resolve

    try:
        d = resolve(ref)
    except FileNotFoundError:
        d = None
    if d is not None:
        try:
            rec = drafter_record(d)
        except ValueError as e:
            raise ConfigError(f"{flag} {ref}: {e}") from None
        if rec.get("kind") in kinds():
            return {"kind": rec["kind"], "options": {"path": str(ref)}}
        if Path(ref).is_dir():
            raise ConfigError(f"{flag} {ref}: the directory has no specula.json naming a drafter kind (one of "
                              f"{', '.join(kinds())}); a drafter trained by 'specula train' writes one")
    if ref in kinds():
        return {"kind": ref, "options": {}}
    raise ConfigError(f"{flag} {ref!r}: neither a drafter directory (with specula.json), a shipped drafter nor a "
                      f"drafter kind ({', '.join(kinds())})")


def speculative_config(spec: str | dict) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON (plus ``drafter.*`` fields) -> a partial ``drafter`` section."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ConfigError(f"--speculative-config: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config: must be a JSON object, e.g. "
                          '\'{"method": "eagle", "model": "runs/eagle", "num_speculative_tokens": 4}\'')
    fields = set(DrafterConfig.model_fields)
    if unknown := sorted(set(spec) - fields - VLLM_KEYS):
        raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (vLLM's: "
                          f"{', '.join(sorted(VLLM_KEYS))}; Specula's: {', '.join(sorted(fields))})")
    out = {k: v for k, v in spec.items() if k in fields}
    if "model" in spec:
        out.update(drafter_from_ref(str(spec["model"]), "--speculative-config model"))
    if "method" in spec:
        kind = METHODS.get(spec["method"], spec["method"])
        if "model" in spec and out["kind"] != kind:
            raise ConfigError(f"--speculative-config: method {spec['method']!r} but model {spec['model']!r} is a "
                              f"{out['kind']!r} drafter")
        out.setdefault("kind", kind)
        if "model" not in spec:
            out.update(drafter_from_ref(kind, "--speculative-config method"))
    if "num_speculative_tokens" in spec:
        out["gamma"] = spec["num_speculative_tokens"]
    if "prompt_lookup_max" in spec:
        out.setdefault("options", {})["max_n"] = spec["prompt_lookup_max"]
    return out


def apply_flags(raw: dict, model: str | None = None, drafter: str | None = None, gamma: int | None = None,
                speculative: str | dict | None = None) -> dict:
    """``raw`` (a config as a dict) with the command line's model, drafter, gamma and speculative config on top.
    A new drafter replaces the old one's kind and options (they belong together); gamma, overlap and the other
    shared fields stay unless given."""
    out = {**raw, "model": dict(raw.get("model") or {}), "drafter": dict(raw.get("drafter") or {})}
    if model is not None:
        out["model"]["path"] = model
    if speculative is not None:
        part = speculative_config(speculative)
        if "kind" in part:
            out["drafter"].pop("options", None)
            out["drafter"].pop("name", None)
        out["drafter"].update(part)
    if drafter is not None:
        if speculative is not None and ("model" in speculative or "method" in speculative):
            raise ConfigError("--drafter and --speculative-config's method/model both name the drafter: give one")
        out["drafter"].pop("name", None)
        out["drafter"].update(drafter_from_ref(drafter))
    if gamma is not None:
        out["drafter"]["gamma"] = gamma
    return out
