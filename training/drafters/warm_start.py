"""Warm starts: a feature-level head begins its training from an exported head of the same kind and shape.

A drafter is distilled from one target; when the target is fine-tuned further (a later training stage of the
shipped one), its hidden states move but stay close, so the drafter exported for the old target is a far better
start than a fresh head: ``specula train eagle --init-from eagle`` (or ``specula zoo build --drafters-only
--warm-from zoo/weights``) retrains it against the new target in a fraction of the samples. Only the head's own
weights come over; the target's embedding and lm_head are attached afresh, and the cached answers are regenerated
for the new target as always.
"""

from __future__ import annotations

import json
from pathlib import Path


def warm_start(head, path: str | Path) -> Path:
    """Load the exported head at ``path`` (a directory or a zoo name) into ``head`` (a fresh ``EagleHead`` or
    subclass) in place; returns the resolved directory. Refuses a head of another kind or another config (sizes,
    layers, visual tokens...): a warm start continues the same model.
    """
    from safetensors.torch import load_file

    from specula.zoo.store import resolve

    d = resolve(path)
    weights, config = d / head.WEIGHTS, d / head.CONFIG
    if not weights.exists() or not config.exists():
        raise ValueError(f"--init-from {path}: {d} holds no {head.KIND} head ({head.WEIGHTS} + {head.CONFIG})")
    theirs = head.CONFIG_CLS.from_json(config.read_text())
    if theirs != head.config:
        raise ValueError(f"--init-from {path}: its {head.KIND} head has another config ({theirs}) than this run's "
                         f"({head.config}); a warm start needs the same shape")
    device = next(head.parameters()).device
    own = head.state_dict()
    loaded = load_file(weights)
    if set(loaded) != set(own):
        raise ValueError(f"--init-from {path}: its tensors ({len(loaded)}) are not this head's ({len(own)})")
    head.load_state_dict({k: v.to(device=device, dtype=own[k].dtype) for k, v in loaded.items()})  # fp16 -> fp32
    return d


def lineage_samples(exported: str | Path) -> int:
    """The training samples behind an exported drafter: its own and those of the heads it was warm-started from
    (``specula.json`` "trained_samples" + "init_samples"); 0 when it says nothing."""
    from specula.zoo.store import resolve

    meta = resolve(exported) / "specula.json"
    info = json.loads(meta.read_text()) if meta.exists() else {}
    return int(info.get("trained_samples") or 0) + int(info.get("init_samples") or 0)
