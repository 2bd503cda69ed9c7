"""The zoo manifest: every shipped file with its size and sha256, checked by ``specula zoo list`` and a test."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specula.zoo.paths import MANIFEST, ZOO_DIR


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
