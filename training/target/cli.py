"""``specula train target``'s flags, one per ``TrainConfig`` field, and its handler.

Each flag is its field's name with dashes (``--code-lm-samples``) unless the field names another (``flag``), with the
field's type, default and help (training/target/config.py); a bool field is ``--flag`` / ``--no-flag``, an
``X | None`` field takes an X. The handler builds the config from the parsed flags and trains; ``--export`` ships the
result. Torch is imported only when the handler runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from specula.training.target.config import TrainConfig


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _value_type(hint) -> type:
    """int, float, str or bool; ``X | None`` -> X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_train_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``TrainConfig`` field as a flag on ``parser``, ``--export``, and the handler (``func``)."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        meta, kind = f.metadata, _value_type(hints[f.name])
        shown = "" if f.default in (None, "") else " (default: %(default)s)"
        kw = dict(dest=f.name, default=f.default, help=meta["help"].replace("%", "%%") + shown)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=kind, metavar=kind.__name__.upper())
            if "choices" in meta:
                kw.update(choices=meta["choices"], metavar=None)
            if "const" in meta:
                kw.update(nargs="?", const=meta["const"])
        parser.add_argument(flag_name(f), **kw)
    parser.add_argument("--export", action="store_true", help="when done, export the weights into the shipped zoo")
    parser.set_defaults(func=train_target_cli)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` the parsed flags describe."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def parse_config(argv: list[str]) -> TrainConfig:
    """The ``TrainConfig`` of a ``specula train target`` command line (the arguments after ``target``)."""
    parser = argparse.ArgumentParser(prog="specula train target")
    add_train_target_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def train_target_cli(args: argparse.Namespace) -> int:
    """Train (or resume) the target the flags describe; ``--export`` ships it when done."""
    from specula.targets.processor import load_processor
    from specula.training.build import export
    from specula.training.target.train import train
    from specula.zoo.store import TOKENIZER_DIR

    ckpt = train(config_from_args(args), load_processor(TOKENIZER_DIR))
    if args.export:
        print(f"exported to {export(ckpt)}")
    return 0
