"""The user's own prompts for ``specula bench spec --prompts FILE``: a prompts file read into ``UserPrompt``s, and
``UserPrompt``s encoded by the checkpoint's processor and chat template (runtime/engine/prompts.py).

A prompts file is JSONL (or a JSON list) of records, image paths relative to the file's folder or ``--image-root``:

    {"id": "q1", "prompt": "What colour is the bus?", "images": ["bus.png"]}
    {"id": "q2", "prompt": "Compare <image> with <image>.", "images": ["a.png", "b.png"], "suite": "compare"}
    {"id": "q3", "prompt": "Name three primes.", "system": "Answer briefly."}

``<image>`` marks where each image goes (one per image), else the images come before the text. ``suite`` labels
the record's row group in the report (default "prompts"). A conversation file (LLaVA-Instruct / ShareGPT4V, told
apart by its records' ``"conversations"``) is read by the training data reader instead (``specula/cli/bench.py``:
this layer does not import training/), each exchange one prompt. Every bad record is named in one error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specula.runtime.engine.prompts import encode_messages, prompt_messages

DEFAULT_SUITE = "prompts"  # the report's label for a record with no "suite"
FIELDS = {"id", "prompt", "images", "system", "suite"}
DOC = "docs/benchmarks.md#your-own-prompts"


@dataclass(frozen=True)
class UserPrompt:
    """One prompt of the user's file, before encoding."""

    id: str
    suite: str
    messages: tuple[dict, ...]  # chat messages (content parts), one {"type": "image"} part per image, in order
    images: tuple[Path, ...]  # resolved paths, one per image part
    where: str  # "prompts.jsonl: record 3 (line 4), id 'q3'": how errors name the record


def file_kind(path: str | Path) -> str:
    """``"conversations"`` when the file's first record has ``"conversations"`` (LLaVA-Instruct / ShareGPT4V), else
    ``"prompts"`` (whose reader names what is wrong with it). A missing file is a FileNotFoundError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        head = f.read(1 << 20).lstrip()
    first = None
    try:
        if head.startswith("["):
            first, _ = json.JSONDecoder().raw_decode(head[1:].lstrip())
        elif head:
            first = json.loads(head.splitlines()[0])
    except ValueError:
        # a list whose first record is over 1 MB is a conversation file; broken JSON is named by the reader
        return "conversations" if head.startswith("[") else "prompts"
    return "conversations" if isinstance(first, dict) and "conversations" in first else "prompts"


def _records(path: Path) -> list[tuple[int, int | None, object]]:
    """(index, line, record) of a JSONL file or a JSON list; a line that is not JSON is a ValueError naming it."""
    text = path.read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return [(i, None, r) for i, r in enumerate(rows)]
    out = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((len(out), line_no, json.loads(line)))
        except ValueError as e:
            raise ValueError(f"{path}: record {len(out)} (line {line_no}) is not valid JSON ({e}); a prompts file "
                             f"holds one JSON record per line (the format: {DOC})") from None
    return out


def _where(path: Path, index: int, line: int | None, rid: object) -> str:
    at = f"{path}: record {index}" + (f" (line {line})" if line is not None else "")
    return at + (f", id {rid!r}" if isinstance(rid, (str, int)) and not isinstance(rid, bool) else "")


def _resolve(p: str, root: Path) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() else root / q


def _parse(rec: object, where: str, index: int, root: Path) -> tuple[UserPrompt | None, list[str]]:
    """The record as a UserPrompt, or None and what is wrong with it."""
    if not isinstance(rec, dict):
        return None, [f"{where}: is not a JSON object ({{\"id\": ..., \"prompt\": \"...\", \"images\": [...]}})"]
    bad = []
    if unknown := sorted(set(rec) - FIELDS):
        bad.append(f"unknown key(s) {', '.join(unknown)} (a record has {', '.join(sorted(FIELDS))})")
    prompt, system, suite = rec.get("prompt"), rec.get("system", ""), rec.get("suite", DEFAULT_SUITE)
    if not isinstance(prompt, str) or not prompt.strip():
        bad.append('"prompt" must be a non-empty string')
    if not isinstance(system, str):
        bad.append('"system" must be a string')
    if not isinstance(suite, str) or not suite.strip():
        bad.append('"suite" must be a non-empty string')
    rid = rec.get("id", f"{suite}-{index}")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        bad.append('"id" must be a string or an integer')
    raw = rec.get("images", [])
    if not isinstance(raw, list) or not all(isinstance(p, str) and p for p in raw):
        bad.append('"images" must be a list of paths, e.g. ["a.png"]')
        raw = []
    paths = tuple(_resolve(p, root) for p in raw)
    for p, full in zip(raw, paths):
        if not full.is_file():
            bad.append(f"image {p!r} is not found (looked for {full}; paths are relative to --image-root, default "
                       "the file's folder)")
    messages = ()
    if isinstance(prompt, str) and isinstance(system, str) and not bad:
        try:
            messages = tuple(prompt_messages(prompt, len(paths), system))
        except ValueError as e:  # <image> marks that do not match the images
            bad.append(str(e))
    if bad:
        return None, [f"{where}: {b}" for b in bad]
    return UserPrompt(str(rid), suite, messages, paths, where), []


def read_prompts(path: str | Path, image_root: str | Path | None = None) -> list[UserPrompt]:
    """Every record of a prompts file, checked (each image must exist); one ValueError names every bad record."""
    path = Path(path)
    root = Path(image_root) if image_root else path.parent
    if image_root and not root.is_dir():
        raise FileNotFoundError(f"--image-root {root}: not a folder")
    prompts, problems, n_bad = [], [], 0
    for index, line, rec in _records(path):
        p, bad = _parse(rec, _where(path, index, line, rec.get("id") if isinstance(rec, dict) else None), index,
                        root)
        problems, n_bad = problems + bad, n_bad + bool(bad)
        if p is not None:
            prompts.append(p)
    seen: dict[str, str] = {}
    for p in prompts:
        if p.id in seen:
            problems.append(f"{p.where}: the id is also {seen[p.id]}'s (ids name the report's rows: make them "
                            "unique)")
            n_bad += 1
        seen.setdefault(p.id, p.where)
    if not problems and not prompts:
        raise ValueError(f"{path}: holds no records (the format: {DOC})")
    if problems:
        raise ValueError(f"{n_bad} bad record(s) in {path} (nothing was measured; the format: {DOC}):\n  "
                         + "\n  ".join(problems))
    return prompts


def first_per_suite(prompts: list[UserPrompt], n: int) -> list[UserPrompt]:
    """The first ``n`` prompts of each suite label, in file order."""
    count: dict[str, int] = {}
    out = []
    for p in prompts:
        count[p.suite] = count.get(p.suite, 0) + 1
        if count[p.suite] <= n:
            out.append(p)
    return out


def encode_user_prompts(processor, prompts: list[UserPrompt]) -> list[tuple]:
    """``[(suite, id, EncodedPrompt)]`` through the checkpoint's chat template and processor; an image that does not
    open is a ValueError naming its record."""
    from PIL import Image

    out = []
    for p in prompts:
        images = []
        for path in p.images:
            try:
                with Image.open(path) as im:
                    images.append(im.convert("RGB"))
            except (OSError, SyntaxError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
                raise ValueError(f"{p.where}: image {path} cannot be read ({type(e).__name__}: {e})") from None
        try:
            out.append((p.suite, p.id, encode_messages(processor, list(p.messages), images)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{p.where}: the checkpoint's processor refused the prompt ({e})") from None
    return out


__all__ = ["DEFAULT_SUITE", "UserPrompt", "encode_user_prompts", "file_kind", "first_per_suite",
           "read_prompts"]
