"""Shared helpers of the reliability suite (a uniquely named module: ``conftest`` names collide across folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

LONG = os.environ.get("SPECULA_LONG", "") not in ("", "0")

# `specula bench report --reliability` sets this to a file in the report folder and reads the figures back
FIGURES_ENV = "SPECULA_FIGURES_OUT"


def scale(short: int, long: int) -> int:
    """A loop bound: ``short`` in CI, ``long`` with SPECULA_LONG=1."""
    return long if LONG else short


def _plain(x):
    """JSON for what a figure's numbers may hold besides ints/floats/strings: tensors' and numpy's scalars."""
    return x.item() if hasattr(x, "item") else str(x)


def record_figure(name: str, line: str, **numbers) -> None:
    """Print a test's figure (``line``, shown with ``pytest -s`` and in the report) and, when $SPECULA_FIGURES_OUT
    names a file, append ``{"test": name, "line": line, "numbers": {...}}`` to it as one JSON line.

    One ``os.write`` on an O_APPEND descriptor: figures of concurrent writers (pytest-xdist workers, several test
    files) land as whole lines. ``name`` is the test function's name, which the report joins with pytest's junit
    outcome.
    """
    print(f"\n{line}")
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    record = json.dumps({"test": name, "line": line, "numbers": numbers}, default=_plain, sort_keys=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (record + "\n").encode())
    finally:
        os.close(fd)
