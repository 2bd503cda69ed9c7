"""The `specula` command: every subcommand explains itself; bad input gives a clear error, not a traceback."""

import subprocess
import sys

import pytest

from specula.cli import build_parser, main

COMMANDS = [[], ["generate"], ["world"], ["world", "sample"], ["bench"], ["bench", "target"], ["bench", "spec"], ["train"],
            ["train", "target"], ["train", "text_lm"], ["train", "eagle"], ["train", "msd"], ["zoo"], ["zoo", "eval"], ["zoo", "probe"], ["zoo", "probe-sets"], ["zoo", "probe-content"], ["zoo", "probe-charts"], ["zoo", "lane"], ["zoo", "lane", "save"], ["zoo", "lane", "restore"], ["zoo", "build"], ["zoo", "promote"], ["serve"],
            ["train", "flash"], ["train", "aasd"], ["train", "massv"], ["bench", "report"], ["bench", "distributed"],
            ["chat"]]


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
