"""Shared helpers of the reliability suite (a uniquely named module: ``conftest`` names collide across folders)."""

from __future__ import annotations

import os

from specula.runtime.bench.report.reliability import FIGURES_ENV, record_figure  # noqa: F401 (the kit's API)

LONG = os.environ.get("SPECULA_LONG", "") not in ("", "0")


def scale(short: int, long: int) -> int:
    """A loop bound: ``short`` in CI, ``long`` with SPECULA_LONG=1."""
    return long if LONG else short
