"""Where a probe command's report goes: ``<stem>.json`` and ``<stem>.md`` under ``--out``, and one of the two printed."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, md: str, out: str | None, stem: str, as_json: bool) -> None:
    """Write ``report`` (JSON-ready) and its markdown ``md`` to ``out/<stem>.json`` / ``.md`` when ``out`` is given;
    print the JSON (``as_json``) or the markdown."""
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (folder / f"{stem}.md").write_text(md + "\n")
    print(json.dumps(report, indent=2) if as_json else md)


def load_source(args):
    """(model, processor) of a probe command's ``--checkpoint`` (rounded to fp16 as exported) or ``--model``."""
    from specula.training.target.evaluate import load_checkpoint, load_model

    if args.checkpoint:
        model, processor, _ = load_checkpoint(args.checkpoint)
        return model, processor
    return load_model(args.model)
