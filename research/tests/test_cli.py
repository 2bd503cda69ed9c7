"""``python -m research``: every research command explains itself, runs from the repository root, and the product's
``specula`` command offers none of them."""

import subprocess
import sys
from pathlib import Path

import pytest

from research.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [[], ["probe"], ["probe-sets"], ["probe-content"], ["probe-charts"], ["lane"], ["lane", "save"],
            ["lane", "restore"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(cmd + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m research" in out and len(out) > 120


def test_runs_as_a_module_from_the_checkout():
    r = subprocess.run([sys.executable, "-m", "research", "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0 and "probe-sets" in r.stdout and "lane" in r.stdout


def test_the_product_command_has_no_research_commands():
    from specula.cli import build_parser as specula_parser

    for cmd in (["zoo", "probe"], ["zoo", "probe-sets"], ["zoo", "lane", "save"]):
        with pytest.raises(SystemExit) as e:
            specula_parser().parse_args(cmd + ["--help"])
        assert e.value.code == 2
