"""What several command handlers share: setting torch's CPU threads from ``--threads``, torch imported only then."""

from __future__ import annotations


def set_threads(args) -> None:
    """``torch.set_num_threads(args.threads)`` when the command has a ``--threads`` and it is set."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
