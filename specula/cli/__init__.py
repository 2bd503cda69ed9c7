"""The ``specula`` command line: one module per command group, each with its parser beside its handler.

    specula generate --image world/assets/sample.png --question "What colour is the circle?"
    specula world sample --suite vqa --n 4 --out /tmp/world
    specula bench target --out reports/target
    specula train target --run-dir runs/target
    specula train msd --no-decouple           # an MSD ablation
    specula zoo list | build | eval --json | export | promote
    specula serve --config specula.yaml
    specula chat --image scene.png "What colour is the circle?"   # ask a running `specula serve` over gRPC

Each group module (``generate``, ``world``, ``bench``, ``train``, ``zoo``, ``serve``, ``chat``) has a
``register(sub)`` that adds its command to the top-level sub-parsers; a subject that defines its own flags beside
its code is mounted from there. Building the parser imports neither torch nor Ray: every handler imports its work
when it runs. The research probes and lane tools are not part of this command: ``python -m research --help``.
"""

from __future__ import annotations

import argparse

from specula.cli import bench, chat, generate, serve, train, world, zoo
from specula.cli.common import run_command

GROUPS = (generate, world, bench, train, zoo, serve, chat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specula",
        description="Specula: lossless speculative decoding for vision-language models. "
                    "Run `specula <command> --help` for each command.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``specula`` with ``argv`` (default: the process's arguments); a bad input is one line and exit 2."""
    return run_command(build_parser(), argv)
