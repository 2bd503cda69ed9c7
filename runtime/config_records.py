"""A trained drafter's record against the model it is served with.

A drafter directory holds ``specula.json`` with its ``kind`` and, when trained by Specula, ``target_sha256``: the
fingerprint of the target's weights it was trained on (``zoo.store.weights_fingerprint``). A drafter trained for
other weights still runs losslessly, but drafts for a different model (its acceptance collapses), so serving one is
refused at start-up with both sides named::

    drafter 'eagle' (/models/eagle-7b) was trained for target weights 3f2a9c1e... but model.path
    /models/llava-13b has b0c5373f...: train it for this model (specula train eagle --target /models/llava-13b) or
    serve the target it was made for
"""

from __future__ import annotations

from pathlib import Path


def _dir(ref) -> Path | None:
    from specula.zoo.store import resolve

    if not isinstance(ref, (str, Path)) or not str(ref):
        return None
    try:
        return resolve(ref)
    except FileNotFoundError:
        return None  # the drafter's own loader says what is missing


def record_mismatches(model_path: str, drafter) -> list[str]:
    """One message per drafter (default and alternatives) whose record names other target weights than
    ``model_path``'s, or another kind than it is configured as. [] when every record fits (or has no fingerprint)."""
    from specula.zoo.store import drafter_record, weights_fingerprint

    named = [(drafter.default_name, drafter.kind, drafter.options)]
    named += [(name, alt.kind, alt.options) for name, alt in drafter.alternatives.items()]
    problems: list[str] = []
    model_dir, model_fp = _dir(model_path), None
    for name, kind, options in named:
        d = _dir(options.get("path"))
        if d is None:
            continue
        try:
            rec = drafter_record(d)
        except ValueError as e:
            problems.append(f"drafter {name!r}: {e}")
            continue
        if rec.get("kind") not in (None, kind) and not _compatible(kind, rec["kind"]):
            problems.append(f"drafter {name!r} ({d}) is a {rec['kind']!r} drafter, configured as kind {kind!r}")
        want = rec.get("target_sha256")
        if not want or model_dir is None:
            continue
        if model_fp is None:
            try:
                model_fp = weights_fingerprint(model_dir)
            except FileNotFoundError:
                return problems  # no weights to compare: the target's loader says so
        if want != model_fp:
            problems.append(
                f"drafter {name!r} ({d}) was trained for target weights {want[:16]}... but model.path {model_dir} "
                f"has {model_fp[:16]}...: train it for this model (specula train {rec.get('kind', kind)} --target "
                f"{model_dir}) or serve the target it was made for")
    return problems


# kinds that read another kind's weights: the massv model also serves the caption / pooled / ensemble drafters
_READS = {"caption": {"massv"}, "pooled": {"massv"}, "ensemble": {"massv"}}


def _compatible(kind: str, recorded: str) -> bool:
    return recorded in _READS.get(kind, set())
