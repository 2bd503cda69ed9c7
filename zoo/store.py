"""The weight store: where the shipped zoo lives, a resolver for model references (a zoo entry name or a local
directory), and the manifest (every shipped file with its size and sha256, checked by ``specula zoo list`` and a
test). The product finds weights through this module only; it imports nothing else of the project."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent / "weights"
TOKENIZER_DIR = ZOO_DIR / "tokenizer"
TARGET_DIR = ZOO_DIR / "target"
MANIFEST = ZOO_DIR / "manifest.json"
# Not shipped: the candidate zoo, a target still in training kept in the repository so that the next session (whose
# checkout has no runs/) continues it with ``--init-from`` instead of retraining it (zoo/TRAINING.md, "A direct
# route"), and the drafters retrained for it so far (``specula zoo promote`` ships the whole set, training/promote.py).
CANDIDATES_DIR = Path(__file__).resolve().parent / "candidates"


def resolve(model: str | Path) -> Path:
    """A zoo entry name ("target") or a path to a local checkpoint directory."""
    p = Path(model)
    if p.is_dir():
        return p
    q = ZOO_DIR / str(model)
    if q.is_dir():
        return q
    raise FileNotFoundError(f"model {model!r} is neither a local directory nor a shipped zoo entry (shipped: "
                            f"{', '.join(shipped()) or 'none'})")


def shipped() -> list[str]:
    """The names of the shipped zoo entries (what ``resolve`` accepts besides a local directory)."""
    return sorted(d.name for d in ZOO_DIR.iterdir() if d.is_dir()) if ZOO_DIR.is_dir() else []


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

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def scan(zoo_dir: Path = ZOO_DIR) -> dict:
    entries = {}
    for d in sorted(p for p in zoo_dir.iterdir() if p.is_dir()):
        files = {f.relative_to(d).as_posix(): {"bytes": f.stat().st_size, "sha256": sha256(f)}
                 for f in sorted(d.rglob("*")) if f.is_file()}
        meta = d / "specula.json"
        info = json.loads(meta.read_text()) if meta.exists() else {}
        entries[d.name] = {"files": files, "bytes": sum(v["bytes"] for v in files.values()), "info": info}
    return {"entries": entries, "total_bytes": sum(e["bytes"] for e in entries.values())}


def write(zoo_dir: Path = ZOO_DIR) -> dict:
    m = scan(zoo_dir)
    (zoo_dir / MANIFEST.name).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    return m


def verify(zoo_dir: Path = ZOO_DIR) -> list[str]:
    """Problems found comparing the files on disk with the manifest (empty = all good)."""
    path = zoo_dir / MANIFEST.name
    if not path.exists():
        return ["no manifest.json"]
    want, have = json.loads(path.read_text()), scan(zoo_dir)
    problems = []
    for name, e in want["entries"].items():
        got = have["entries"].get(name)
        if got is None:
            problems.append(f"{name}: missing")
            continue
        for f, v in e["files"].items():
            g = got["files"].get(f)
            if g is None:
                problems.append(f"{name}/{f}: missing")
            elif g["sha256"] != v["sha256"]:
                problems.append(f"{name}/{f}: sha256 differs from the manifest")
    return problems


def list_cli(args) -> int:
    m = scan()
    for name, e in m["entries"].items():
        info = e["info"]
        extra = ", ".join(f"{k}={v}" for k, v in info.items() if k in ("kind", "params", "trained_samples", "train_minutes"))
        print(f"{name:16s} {e['bytes'] / 1e6:8.2f} MB  {len(e['files'])} files  {extra}")
    print(f"{'total':16s} {m['total_bytes'] / 1e6:8.2f} MB (budget 150 MB)")
    problems = verify()
    print("manifest: ok" if not problems else "manifest problems:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


def weights_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the sha256 of each ``*.safetensors`` file of a checkpoint, in name order: what a drafter's record
    (``specula.json``'s ``target_sha256``) names its target by, and what cached training answers are keyed by.

    Hashing a large checkpoint takes a while, so each file's digest is cached by (absolute path, size, mtime) in
    ``$SPECULA_CACHE`` (default ``~/.cache/specula``)/fingerprints.json; a changed file is hashed again."""
    import os

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to fingerprint")
    cache_file = Path(os.environ.get("SPECULA_CACHE", Path.home() / ".cache" / "specula")) / "fingerprints.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    digests, changed = [], False
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in cache:
            cache[key], changed = sha256(f), True
        digests.append(cache[key])
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_file)
        except OSError:
            pass  # a read-only home: the fingerprint is still right, only not cached
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def drafter_record(drafter_dir: str | Path) -> dict:
    """The record (``specula.json``) of a trained drafter's directory: at least its ``kind``; ``target_sha256`` names
    the target it was trained for. {} when the directory has none."""
    meta = Path(drafter_dir) / "specula.json"
    if not meta.is_file():
        return {}
    try:
        rec = json.loads(meta.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{meta}: not valid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{meta}: must be a JSON object")
    return rec
