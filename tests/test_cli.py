"""The `specula` command: every subcommand explains itself; bad input gives a clear error, not a traceback; each
command group is built by its own module (specula/cli/), and parsing imports neither torch nor Ray."""

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from specula.cli import build_parser, main

COMMANDS = [[], ["generate"], ["world"], ["world", "sample"], ["world", "suites"], ["bench"], ["bench", "target"],
            ["bench", "spec"], ["bench", "report"], ["bench", "distributed"], ["bench", "outcomes"],
            ["bench", "reference"], ["train"], ["train", "target"], ["train", "text_lm"], ["train", "eagle"],
            ["train", "msd"], ["train", "flash"], ["train", "aasd"], ["train", "massv"], ["zoo"], ["zoo", "list"],
            ["zoo", "eval"], ["zoo", "build"], ["zoo", "promote"], ["zoo", "splice"], ["zoo", "refit-projector"],
            ["zoo", "export"], ["serve"], ["chat"]]
GROUPS = ["generate", "world", "bench", "train", "zoo", "serve", "chat"]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(cmd + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: specula" in out and len(out) > 120


def test_console_script_is_installed():
    r = subprocess.run([sys.executable, "-m", "specula.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generate" in r.stdout


def test_generate_missing_image_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--image", str(tmp_path / "nope.png"), "--question", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_unreadable_image_is_a_clear_error(capsys, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    assert main(["generate", "--image", str(bad), "--question", "hi", "--model", "tokenizer"]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_world_suites_lists_every_suite(capsys):
    from specula.world import SUITES

    assert main(["world", "suites"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUITES)


def test_serve_needs_no_config():
    """`specula serve` alone serves the shipped default; the ports can be moved from the command line."""
    args = build_parser().parse_args(["serve", "--port", "8100", "--grpc-port", "50100"])
    assert args.config is None and args.port == 8100 and args.grpc_port == 50100


def _leaves(parser: argparse.ArgumentParser, path=()) -> dict:
    """Every command path under ``parser`` -> (its flags, its handler); sub-command groups are walked into."""
    out, flags = {}, []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, p in a.choices.items():
                out.update(_leaves(p, path + (name,)))
        elif not isinstance(a, argparse._HelpAction):
            flags.append((tuple(a.option_strings), a.dest, repr(a.default)))
    out[path] = (flags, parser.get_default("func"))
    return out


def _top_level(parser: argparse.ArgumentParser) -> dict:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("name", GROUPS)
def test_each_group_is_built_by_its_own_module(name):
    """``specula.cli.<group>.register`` adds that command alone, the same one ``specula`` has, and its handlers are
    that module's (for ``train``: the training side's)."""
    module = importlib.import_module(f"specula.cli.{name}")
    sub = argparse.ArgumentParser(prog="specula").add_subparsers()
    module.register(sub)
    assert set(sub.choices) == {name}
    mine, shipped = _leaves(sub.choices[name]), _leaves(_top_level(build_parser())[name])
    assert {k: v[0] for k, v in mine.items()} == {k: v[0] for k, v in shipped.items()}
    handlers = {func.__module__ for _, func in mine.values() if func is not None}
    if name == "train":  # mounted from the training side: training/target/cli.py, training/drafters/commands.py
        assert handlers == {"specula.training.target.cli", "specula.training.drafters.commands"}, handlers
    else:
        assert handlers == {module.__name__}


def _flags_of(add) -> list:
    p = argparse.ArgumentParser()
    add(p)
    return _leaves(p)[()][0]


def test_subjects_with_their_own_flags_are_mounted_not_copied():
    from specula.runtime.bench.distributed import add_arguments as distributed
    from specula.runtime.bench.outcomes import add_arguments as outcomes
    from specula.runtime.bench.reference import add_arguments as reference
    from specula.runtime.bench.report.args import add_arguments as report
    from specula.runtime.engine.generate import add_generate_arguments
    from specula.runtime.serve.launch import add_serve_arguments

    leaves = _leaves(build_parser())
    assert leaves[("generate",)][0] == _flags_of(add_generate_arguments)
    assert leaves[("serve",)][0] == _flags_of(add_serve_arguments)
    assert leaves[("bench", "report")][0] == _flags_of(report)
    assert leaves[("bench", "distributed")][0] == _flags_of(distributed)
    assert leaves[("bench", "outcomes")][0] == _flags_of(outcomes)
    assert leaves[("bench", "reference")][0] == _flags_of(reference)


def test_drafter_training_commands_come_from_the_training_side():
    """``specula train KIND`` for a drafter is training/drafters/commands.py's parser, the one ``zoo build`` runs
    the recipe's drafters with (``run_train_argv``)."""
    from specula.training.drafters.commands import KINDS, train_parser

    cli, training = _leaves(build_parser()), _leaves(train_parser())
    for kind in KINDS:
        assert cli[("train", kind)] == training[("train", kind)]


def test_zoo_build_runs_drafters_without_the_cli(monkeypatch):
    """The recipe's drafter argv goes through the training side's parser to the trainer's handler."""
    from specula.training.drafters import commands, eagle

    seen = []
    monkeypatch.setattr(eagle, "train_eagle_cli", lambda args: seen.append(args) or 0)
    assert commands.run_train_argv(["train", "eagle", "--run-dir", "runs/x", "--samples", "7"]) == 0
    assert seen[0].run_dir == "runs/x" and seen[0].samples == 7 and seen[0].train_cmd == "eagle"


def test_help_imports_neither_torch_nor_ray():
    code = ("import contextlib, io, json, sys\n"
            "from specula.cli import main\n"
            "for argv in ([], ['train', 'target'], ['bench', 'outcomes'], ['bench', 'reference'], ['serve'],\n"
            "             ['chat'], ['generate']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv + ['--help'])\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ray', 'grpc', 'transformers', 'research'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
