"""Conversation files (LLaVA-Instruct / ShareGPT4V format): read, check every rule before training, write.

A file is a JSON list or JSONL (told apart by its first character, not its name; both are streamed) of records

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",     # or ["a.png", "b.png"], or no "image"
     "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                       {"from": "gpt", "value": "The bus is white and red."}, ...]}

Every rule and the error it gives is in docs/training-data.md. Nothing raises on the first bad record: problems are
collected over the whole file (and the image and length checks), then one ``DataError`` lists them, like a compiler:

    >>> load_conversations("bad.jsonl")
    DataError: 2 bad records in bad.jsonl (nothing was trained; the format: docs/training-data.md):
      bad.jsonl: record 3 (line 4), id '17': turn 2 has role 'bot' -- use human/user, gpt/assistant or system
      bad.jsonl: record 9 (line 10), id '42': has 2 <image> markers but 1 image -- one <image> per image, ...

``read_conversations`` applies the rules a file alone can answer; ``checks.load_conversations`` adds the image and
length checks (training/data/checks.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

from tqdm import tqdm

log = logging.getLogger(__name__)

IMAGE_MARK = "<image>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAX_SHOWN = 20  # problems printed in a DataError; all are counted
_KEPT = 10_000  # problems kept in memory; beyond that only counted
_CHUNK = 1 << 20  # characters read at a time from a JSON list
_SPACE = re.compile(r"[ \t\r\n]*")
DOC = "docs/training-data.md"

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Turn:
    role: Role
    text: str  # as written in the file, ``<image>`` markers kept (messages.py puts the images in their place)


@dataclass(frozen=True)
class Conversation:
    """One checked record: ``turns`` are [system], user, assistant, user, assistant, ..., ending with an assistant
    turn; ``images`` are the resolved paths, one per ``<image>`` marker in turn order."""

    id: str  # the record's id as a string (an int id 7 -> "7"); "#<index>" when the record has none
    images: tuple[Path, ...]
    turns: tuple[Turn, ...]
    index: int = 0  # the record's position in its file, from 0
    source: str = ""  # the file it came from


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file or a record (``index`` None: the file as a whole)."""

    file: str
    index: int | None
    id: str | None
    what: str
    hint: str = ""
    line: int | None = None  # JSONL line / the line a JSON list record starts on, from 1

    def __str__(self) -> str:
        where = self.file
        if self.index is not None:
            where += f": record {self.index}" + (f" (line {self.line})" if self.line is not None else "")
            where += f", id {self.id!r}" if self.id is not None else ", no id"
        return f"{where}: {self.what}" + (f" -- {self.hint}" if self.hint else "")


class DataError(ValueError):
    """Bad training data: every problem found, the first ``MAX_SHOWN`` of them in the message."""

    def __init__(self, problems: Sequence[Problem], n_problems: int | None = None, n_bad: int | None = None,
                 max_shown: int = MAX_SHOWN):
        self.problems = tuple(problems)
        self.n_problems = len(self.problems) if n_problems is None else n_problems
        records = {(p.file, p.index) for p in self.problems if p.index is not None}
        self.n_bad = len(records) if n_bad is None else n_bad
        files = sorted({p.file for p in self.problems})
        if self.n_bad:
            head = f"{self.n_bad} bad record{'s' if self.n_bad != 1 else ''} in {', '.join(files)}"
        else:
            head = f"{', '.join(files)} is not a conversation file"
        lines = [f"  {p}" for p in self.problems[:max_shown]]
        if self.n_problems > len(lines):
            lines.append(f"  ... and {self.n_problems - len(lines)} more problems (the first {len(lines)} shown)")
        super().__init__(f"{head} (nothing was trained; the format: {DOC}):\n" + "\n".join(lines))


class _Problems:
    """Collects problems: keeps the first ``_KEPT``, counts all and the records they are in."""

    def __init__(self) -> None:
        self.items: list[Problem] = []
        self.n = 0
        self.bad: set[tuple[str, int]] = set()

    def add(self, p: Problem) -> None:
        self.n += 1
        if p.index is not None:
            self.bad.add((p.file, p.index))
        if len(self.items) < _KEPT:
            self.items.append(p)

    def error(self, max_shown: int = MAX_SHOWN) -> DataError | None:
        return DataError(self.items, self.n, len(self.bad), max_shown) if self.n else None


# ---- reading -------------------------------------------------------------------------------------------------------

def _records(path: Path, out: _Problems, progress: bool) -> Iterator[tuple[int, int, object]]:
    """(index, line, parsed record) for every record of a JSON list or JSONL file; what cannot be parsed goes to
    ``out`` (a bad JSONL line is one bad record; a broken JSON list ends the file)."""
    file = str(path)
    if not path.exists():
        out.add(Problem(file, None, None, "not found", "check the --data path"))
        return
    if path.is_dir():
        out.add(Problem(file, None, None, "is a folder, not a file", "give the .json / .jsonl file inside it"))
        return
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # bad bytes are found where they are, below
        head = f.read(4096)
    first = head.lstrip()[:1]
    if not first:
        out.add(Problem(file, None, None, "is empty", "a conversation file holds a JSON list of records or JSONL"))
    elif first == "[":
        yield from _json_list(path, out, progress)
    elif first == "{" or _first_line_parses(path):  # a JSONL of non-objects: each line a bad record
        yield from _jsonl(path, out, progress)
    else:
        out.add(Problem(file, None, None, f"is not JSON (it starts with {first!r})",
                        "a conversation file is a JSON list [{...}, ...] or one JSON record per line (JSONL)"))


def _first_line_parses(path: Path) -> bool:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    json.loads(line)
                    return True
                except json.JSONDecodeError:
                    return False
    return False


def _bar(path: Path, progress: bool) -> tqdm:
    return tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"reading {path.name}", leave=False,
                mininterval=2.0, disable=not progress)


class _Stop(Exception):
    """A JSON list that cannot be read further (the problem is already recorded)."""


def _json_list(path: Path, out: _Problems, progress: bool) -> Iterator[tuple[int, int, object]]:
    try:
        yield from _json_list_records(path, out, progress)
    except _Stop:
        return


def _json_list_records(path: Path, out: _Problems, progress: bool) -> Iterator[tuple[int, int, object]]:
    """A JSON list read record by record (``raw_decode`` on a buffer refilled as it is consumed), so a 1 GB file is
    never one string. ``line`` is always the line of ``buf[pos]``."""
    dec = json.JSONDecoder()
    file = str(path)
    with open(path, encoding="utf-8-sig") as f, _bar(path, progress) as bar:
        buf, pos, line, eof, chunk = "", 0, 1, False, _CHUNK

        def go(to: int) -> None:
            nonlocal pos, line
            line += buf.count("\n", pos, to)
            pos = to

        def more() -> bool:  # appends a chunk, dropping what was consumed; False at the end of the file
            nonlocal buf, pos, eof
            if not eof:
                try:
                    got = f.read(chunk)
                except UnicodeDecodeError as e:
                    out.add(Problem(file, None, None, f"is not UTF-8 text ({e.reason}, after line {line})",
                                    "a conversation file is UTF-8 JSON"))
                    raise _Stop from None
                bar.update(max(0, min(f.buffer.tell(), bar.total) - bar.n))
                buf, pos, eof = buf[pos:] + got, 0, not got
            return not eof

        def skip() -> str:  # the next non-space character ("" at the end of the file), pos left on it
            while True:
                go(_SPACE.match(buf, pos).end())
                if pos < len(buf) or not more():
                    return buf[pos:pos + 1]

        def broken(what: str, index: int) -> None:
            out.add(Problem(file, None, None, f"is not valid JSON: {what} at line {line} (in record {index})",
                            "fix the JSON syntax there (a JSON list must be [{...}, {...}])"))

        skip()
        go(pos + 1)  # the "[" that told us the format
        index = 0
        while True:
            c = skip()
            if c == "]":
                go(pos + 1)
                if skip():
                    broken("text after the closing ]", index)
                return
            if index:
                if c != ",":
                    broken("expected ',' or ']' between records" if c else "the list is not closed with ]", index)
                    return
                go(pos + 1)
                c = skip()
            if not c:
                broken("the list is not closed with ]", index)
                return
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    if end < len(buf) or eof:  # a value that ends the buffer may be cut (a number)
                        break
                except json.JSONDecodeError as e:
                    if eof:  # the whole rest of the file is in buf: the record is broken, not cut by the buffer
                        cut = not buf[e.pos:].strip()
                        go(e.pos)
                        broken("the file ends inside a record (was it cut short?)" if cut else e.msg, index)
                        return
                more()
                chunk = min(chunk * 2, 1 << 28)  # a record bigger than the buffer: read more at a time
            yield index, line, obj
            go(end)
            index += 1
            if pos > _CHUNK:  # drop what was consumed
                buf, pos = buf[pos:], 0


def _jsonl(path: Path, out: _Problems, progress: bool) -> Iterator[tuple[int, int, object]]:
    file = str(path)
    index = 0
    with open(path, "rb") as f, _bar(path, progress) as bar:
        for line_no, raw in enumerate(f, start=1):
            bar.update(len(raw))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.add(Problem(file, index, None, f"line {line_no} is not UTF-8 text ({e.reason} at byte {e.start})",
                                "a conversation file is UTF-8 JSON", line_no))
                index += 1
                continue
            if line_no == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                if index == 0:  # maybe one pretty-printed JSON object rather than JSONL
                    whole = _whole_object(path)
                    if whole is not None:
                        out.add(whole)
                        return
                out.add(Problem(file, index, None, f"line {line_no} is not valid JSON ({e.msg}, column {e.colno})",
                                "JSONL holds one whole JSON record per line", line_no))
                index += 1
                continue
            yield index, line_no, obj
            index += 1


def _whole_object(path: Path) -> Problem | None:
    """The problem of a file that is one JSON object (not a list, not JSONL); None if it is not one."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    lists = [k for k, v in obj.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
    hint = (f"its {lists[0]!r} key holds a list of records: write that list alone" if lists else
            "wrap the records in a JSON list [{...}, ...] or write one per line (JSONL)")
    return Problem(str(path), None, None, "is one JSON object spread over lines, not a list of records or JSONL",
                   hint)


def _parse(rec: object, index: int, line: int, file: str, files: _Files,
           out: _Problems) -> tuple[Conversation | None, bool]:
    """The record as a Conversation (None if anything is wrong: each problem goes to ``out``), and whether an
    unanswered last user turn was dropped."""
    rid: str | None = None
    n0 = out.n

    def bad(what: str, hint: str = "") -> None:
        out.add(Problem(file, index, rid, what, hint, line))

    if not isinstance(rec, dict):
        bad(f"is a JSON {_kind(rec)}, not an object",
            'each record is {"id": ..., "image": ..., "conversations": [...]}')
        return None, False
    raw_id = rec.get("id")
    if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool):
        rid = str(raw_id)
    elif raw_id is not None:
        bad(f'"id" is a JSON {_kind(raw_id)}', "an id is a string or an integer")

    # images
    if "image" in rec and "images" in rec:
        bad('has both "image" and "images"', 'keep one: "image": "a.png" or "image": ["a.png", "b.png"]')
    raw = rec.get("image", rec.get("images"))
    paths: list[str] = []
    if isinstance(raw, str):
        paths = [raw] if raw else []
    elif isinstance(raw, list) and all(isinstance(p, str) and p for p in raw):
        paths = list(raw)
    elif raw is not None:
        bad('"image" must be a path or a list of paths', 'e.g. "image": "coco/1.jpg" or "image": ["a.png", "b.png"]')

    # turns
    convo = rec.get("conversations")
    if convo is None:
        bad('has no "conversations"',
            'add "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]')
        return None, False
    if not isinstance(convo, list):
        bad(f'"conversations" is a JSON {_kind(convo)}, not a list of turns',
            '"conversations": [{"from": "human", "value": "..."}, ...]')
        return None, False
    if not convo:
        bad('"conversations" is empty', "drop the record or give it a human turn and a gpt turn")
        return None, False
    turns: list[Turn] = []
    for k, t in enumerate(convo):
        if not isinstance(t, dict):
            bad(f"turn {k} is a JSON {_kind(t)}, not an object", '{"from": "human", "value": "..."}')
            continue
        who = t.get("from", t.get("role"))
        value = t.get("value", t.get("content"))
        role = ROLES.get(who.strip().lower()) if isinstance(who, str) else None
        if who is None:
            bad(f'turn {k} has no "from"', 'each turn is {"from": "human" | "gpt" | "system", "value": "..."}')
        elif role is None:
            bad(f"turn {k} has role {who!r}", "use human/user, gpt/assistant or system")
        if not isinstance(value, str):
            bad(f'turn {k} has no text ("value" is {"missing" if value is None else "a JSON " + _kind(value)})',
                '"value" is the turn\'s text, a string')
        if role is not None and isinstance(value, str):
            turns.append(Turn(role, value))  # type: ignore[arg-type]
    if out.n > n0:
        return None, False

    # order: [system] user assistant user assistant ...
    start = 1 if turns[0].role == "system" else 0
    for k, t in enumerate(turns):
        want = "system" if k < start else ("user", "assistant")[(k - start) % 2]
        if t.role != want:
            after = f"after {_a(turns[k - 1].role)} turn" if k else "at the start"
            hint = ("a system turn may only come first" if t.role == "system" else
                    "a conversation starts with a human turn (after an optional system turn)" if k == start else
                    "turns alternate human, gpt: merge the two turns or drop one")
            bad(f"turn {k} is {_a(t.role)} turn {after}", hint)
            return None, False
        if t.role != "user" and IMAGE_MARK in t.text:
            bad(f"turn {k} ({t.role}) holds an {IMAGE_MARK} marker", "images belong in human turns")
        if t.role == "assistant" and not t.text.strip():
            bad(f"turn {k} is an empty answer", "give the answer's text or drop the turn and the question before it")
    dropped = False
    if turns[-1].role == "user" and len(turns) > start + 1:
        if IMAGE_MARK in turns[-1].text:
            bad(f"the last turn ({len(turns) - 1}) is an unanswered human turn with an {IMAGE_MARK} marker",
                "add its answer or move the image into an answered turn")
        else:
            turns.pop()  # ShareGPT dumps often end on a question the model never answered: nothing to train on
            dropped = True
    if not any(t.role == "assistant" for t in turns):
        bad("has no gpt (assistant) turn", 'add the answer, {"from": "gpt", "value": "..."}, or drop the record')

    marks = sum(t.text.count(IMAGE_MARK) for t in turns)
    if marks != len(paths):
        if marks == 0:
            bad(f"has {len(paths)} image{'s' if len(paths) > 1 else ''} but no {IMAGE_MARK} marker",
                f'put "{IMAGE_MARK}\\n" where each image goes, usually at the start of the first human turn')
        else:
            bad(f"has {marks} {IMAGE_MARK} marker{'s' if marks != 1 else ''} but {len(paths)} image"
                f"{'s' if len(paths) != 1 else ''}", f"one {IMAGE_MARK} per image, in the order of \"image\"")
    resolved = tuple(files.path(p) for p in paths)
    if files.check:
        for p, full in zip(paths, resolved):
            if not files.exists(full):
                bad(f"image {p!r} is not found (looked for {full})",
                    "check --image-root: image paths are relative to it")
    if out.n > n0:
        return None, dropped
    return Conversation(rid if rid is not None else f"#{index}", resolved, tuple(turns), index, file), dropped


class _Files:
    """Image paths resolved against the image root and checked for existence, each distinct path once (LLaVA sets
    ask many conversations about one image)."""

    def __init__(self, root: Path, check: bool):
        self.root, self.check = root, check
        self._paths: dict[str, Path] = {}
        self._exists: dict[Path, bool] = {}

    def path(self, p: str) -> Path:
        if (q := self._paths.get(p)) is None:
            q = Path(p).expanduser()
            q = self._paths[p] = q if q.is_absolute() else self.root / q
        return q

    def exists(self, q: Path) -> bool:
        if (e := self._exists.get(q)) is None:
            e = self._exists[q] = q.is_file()
        return e


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"


def _kind(v: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _read(path: str | Path, image_root: str | Path | None, check_files: bool, progress: bool,
          out: _Problems) -> list[Conversation]:
    path = Path(path)
    root = Path(image_root) if image_root is not None else path.parent
    if check_files and image_root is not None and not root.is_dir():
        out.add(Problem(str(path), None, None, f"the image root {root} is not a folder", "check --image-root"))
        check_files = False
    convs, n_records, n_dropped, files = [], 0, 0, _Files(root, check_files)
    for index, line, rec in _records(path, out, progress):
        n_records += 1
        conv, dropped = _parse(rec, index, line, str(path), files, out)
        n_dropped += dropped
        if conv is not None:
            convs.append(conv)
    if n_records == 0 and out.n == 0:
        out.add(Problem(str(path), None, None, "holds no records", "give at least one record"))
    if n_dropped:
        log.warning("%s: dropped the unanswered last human turn of %d record%s", path, n_dropped,
                    "s" if n_dropped > 1 else "")
    return convs


def read_conversations(path: str | Path, image_root: str | Path | None = None, *, check_files: bool = True,
                       max_errors: int = MAX_SHOWN, progress: bool = True) -> list[Conversation]:
    """Every record of ``path`` checked against the format's rules (images must exist under ``image_root``, default
    the file's folder, unless ``check_files`` is False); raises one DataError listing every problem."""
    out = _Problems()
    convs = _read(path, image_root, check_files, progress, out)
    if (err := out.error(max_errors)) is not None:
        raise err
    return convs


# ---- helpers shared by the checks and messages.py ------------------------------------------------------------

def _image_problem(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()  # reads the header and the chunk structure, decodes nothing
    except FileNotFoundError:
        return f"image {path} is not found"
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, SyntaxError, OSError, struct.error)
        return f"image {path} cannot be read ({type(e).__name__}: {e})"
    return None


def _problem(c: Conversation, what: str, hint: str = "") -> Problem:
    return Problem(c.source, c.index, None if c.id.startswith("#") else c.id, what, hint)



# ---- writing -------------------------------------------------------------------------------------------------------

def to_record(conv: Conversation, image_root: str | Path | None = None) -> dict:
    """The file record of ``conv`` (image paths relative to ``image_root`` where they lie under it)."""
    images = [_relative(p, Path(image_root)) if image_root is not None else str(p) for p in conv.images]
    who = {"user": "human", "assistant": "gpt", "system": "system"}
    rec: dict = {"id": conv.id}
    if images:
        rec["image"] = images[0] if len(images) == 1 else images
    rec["conversations"] = [{"from": who[t.role], "value": t.text} for t in conv.turns]
    return rec


def _relative(p: Path, root: Path) -> str:
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(p.resolve())


def write_records(out_file: str | Path, records: Iterable[dict], *, total: int | None = None, progress: bool = True,
                  desc: str = "writing") -> int:
    """Streams ``records`` to ``out_file``: JSONL if it ends in ``.jsonl``, else a JSON list (one record a line).
    Written to a temporary file then renamed, so a crash never leaves half a file. Returns the number written."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    jsonl = out.suffix == ".jsonl"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        if not jsonl:
            f.write("[")
        for rec in tqdm(records, total=total, desc=desc, unit="record", leave=False, mininterval=2.0,
                        disable=not progress):
            text = json.dumps(rec, ensure_ascii=False)
            f.write(f"{text}\n" if jsonl else f"{',' if n else ''}\n{text}")
            n += 1
        if not jsonl:
            f.write("\n]\n")
    os.replace(tmp, out)
    return n
