"""What several command lines share: running a parsed command with one-line errors, and setting torch's CPU
threads from ``--threads`` (torch imported only then)."""

from __future__ import annotations

import argparse
import sys


def set_threads(args) -> None:
    """``torch.set_num_threads(args.threads)`` when the command has a ``--threads`` and it is set."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command; a bad input (``ValueError``,
    ``FileNotFoundError``) is one line on stderr and exit status 2, not a traceback."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
