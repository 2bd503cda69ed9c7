"""``specula train target | text_lm | eagle | msd | massv | flash | aasd``: train a model of the embedded family.

Only mounts: the drafters' parsers and handlers live beside their training code (training/drafters/commands.py),
the target's in ``specula.cli.train_target``.
"""

from __future__ import annotations

from specula.cli.train_target import HELP as TARGET_HELP
from specula.cli.train_target import add_train_target_arguments
from specula.training.drafters.commands import add_drafter_parsers


def register(sub) -> None:
    """Add ``train`` and its commands to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("train", help="train a model of the embedded family (resumable)",
                       description="Train the target on the world, or a drafter distilled from the target's own "
                                   "answers; every run resumes from its --run-dir.")
    tsub = p.add_subparsers(dest="train_cmd", required=True)
    add_train_target_arguments(tsub.add_parser("target", help=TARGET_HELP))
    add_drafter_parsers(tsub)
