"""``specula train target | text_lm | eagle | msd | massv | flash | aasd``: train a model of the embedded family.

Only mounts: each parser and handler lives beside its training code, the target's in training/target/cli.py (its
flags derived from ``TrainConfig``), the drafters' in training/drafters/commands.py.
"""

from __future__ import annotations

from specula.training.drafters.commands import add_drafter_parsers
from specula.training.target.cli import add_train_target_arguments


def register(sub) -> None:
    """Add ``train`` and its commands to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("train", help="train a model of the embedded family (resumable)",
                       description="Train the target on the world, or a drafter distilled from the target's own "
                                   "answers; every run resumes from its --run-dir.")
    tsub = p.add_subparsers(dest="train_cmd", required=True)
    add_train_target_arguments(tsub.add_parser(
        "target", help="train the embedded LLaVA target from scratch on the world (resumes from run-dir)",
        description="Train the target through its stages (code LM, vision, projector fit, joint) on the embedded "
                    "world; every flag is a field of TrainConfig (training/target/config.py)."))
    add_drafter_parsers(tsub)
