"""Where the shipped zoo lives, and a resolver for model references (a zoo name or a local directory)."""

from __future__ import annotations

from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent / "weights"
TOKENIZER_DIR = ZOO_DIR / "tokenizer"
TARGET_DIR = ZOO_DIR / "target"
MANIFEST = ZOO_DIR / "manifest.json"
# Not shipped: a target still in training, kept in the repository so that the next session (whose checkout has no
# runs/) continues it with ``--init-from`` instead of retraining it (zoo/TRAINING.md, "A direct route").
CANDIDATES_DIR = Path(__file__).resolve().parent / "candidates"


def resolve(model: str | Path) -> Path:
    """A zoo entry name ("target") or a path to a local checkpoint directory."""
    p = Path(model)
    if p.is_dir():
        return p
    q = ZOO_DIR / str(model)
    if q.is_dir():
        return q
    shipped = ", ".join(sorted(d.name for d in ZOO_DIR.iterdir() if d.is_dir())) if ZOO_DIR.is_dir() else "none"
    raise FileNotFoundError(f"model {model!r} is neither a local directory nor a shipped zoo entry (shipped: {shipped})")
