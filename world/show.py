"""``specula world sample``: write samples as PNGs plus a markdown page and JSON lines, for people to look at."""

from __future__ import annotations

import json
from pathlib import Path

from specula.world.suites import SUITES, generate


def write_samples(out: str | Path, suites: list[str] | None, n: int, split: str = "eval", seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = suites or list(SUITES)
    md = ["# Specula world samples", ""]
    with open(out / "samples.jsonl", "w") as jl:
        for name in names:
            md.append(f"## {name} ({SUITES[name].mirrors})" if name in SUITES else f"## {name}")
            for i in range(n):
                s = generate(name, split, i, seed)
                files = []
                for k, im in enumerate(s.images):
                    f = f"{name}_{i}_{k}.png"
                    im.save(out / f)
                    files.append(f)
                rec = {"suite": name, "index": i, "kind": s.kind, "images": files, "prompt": s.prompt,
                       "response": s.response, "answer": s.answer, "attributes": list(s.attributes)}
                jl.write(json.dumps(rec) + "\n")
                md.append(" ".join(f"![]({f})" for f in files))
                md.append(f"- **prompt**: {s.prompt}\n- **response**: {s.response}\n")
    (out / "README.md").write_text("\n".join(md) + "\n")
    return out
