"""``specula generate``: answer a question about images. The flags and the work live in runtime/engine/generate.py."""

from __future__ import annotations

from specula.cli.common import set_threads
from specula.runtime.engine.generate import add_generate_arguments


def register(sub) -> None:
    """Add ``generate`` to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("generate", help="answer a prompt about one or more images with a target model",
                       description="Load a target (the shipped embedded target by default, or a local checkpoint "
                                   "directory) and answer a question about images; prints the answer and tokens/s.")
    add_generate_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    set_threads(args)
    from specula.runtime.engine.generate import main

    return main(args)
