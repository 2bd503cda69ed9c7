"""Where the shipped zoo lives, and a resolver for model references (a zoo name or a local directory)."""

from __future__ import annotations

from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent / "weights"
TOKENIZER_DIR = ZOO_DIR / "tokenizer"
TARGET_DIR = ZOO_DIR / "target"
MANIFEST = ZOO_DIR / "manifest.json"
# Not shipped: the candidate zoo, a target still in training kept in the repository so that the next session (whose
# checkout has no runs/) continues it with ``--init-from`` instead of retraining it (zoo/TRAINING.md, "A direct
# route"), and the drafters retrained for it so far (``specula zoo promote`` ships the whole set, zoo/promote.py).
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


def resolve_ref(ref: str | Path, record_dir: str | Path) -> Path:
    """A model named in the record of the exported model in ``record_dir`` (``sibling_ref``'s output): an entry name
    is first looked up beside ``record_dir`` (the zoo it was exported into: a candidate zoo's drafter names the
    candidate target), then as ``resolve`` would."""
    beside = Path(record_dir).parent / str(ref)
    if not Path(ref).is_absolute() and len(Path(ref).parts) == 1 and beside.is_dir():
        return beside
    return resolve(ref)


def sibling_ref(ref: str, out: str | Path) -> str:
    """How a model exported to ``out`` records another model it came from (its target, the LM it started from):
    an entry of the same zoo directory (``zoo/weights/target`` beside ``zoo/weights/eagle``, or a staged
    ``runs/zoo-next/target`` beside ``runs/zoo-next/eagle``) by its entry name, so that the record still resolves
    once the zoo moves; anything else as given."""
    p = Path(ref)
    if p.is_dir() and p.resolve().parent == Path(out).resolve().parent:
        return p.name
    return str(ref)
