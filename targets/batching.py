"""Grouping rows of different lengths for padded forwards.

A batched forward pads every row to the longest one. On a CPU (and for long prompts anywhere) the padded slots cost
what real ones do, so a batch of a 9-token text prompt and a 600-token five-image prompt costs eight times what its
two rows cost alone. ``length_groups`` splits rows into groups whose padding stays within a bound; each group runs
as one forward (the target's prefill, the drafters' member prefills).
"""

from __future__ import annotations

from collections.abc import Sequence


def length_groups(lengths: Sequence[int], slack: float = 1.25) -> list[list[int]]:
    """Indices of rows grouped for padded forwards: longest first, a row joins the current group while the group's
    padded size (its longest row x its rows) stays within ``slack`` x its real tokens (an empty row counts one)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest = real = 0
    for i in order:
        n = max(int(lengths[i]), 1)
        if groups and longest * (len(groups[-1]) + 1) <= slack * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            longest = real = n
    return groups
