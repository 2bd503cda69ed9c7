"""`specula generate` on the shipped target: speculative with the default drafter next to plain decoding of the same
question, `--drafter none` plain only, unknown drafters refused by name. Real models; timings are never asserted."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specula.cli import main
from specula.runtime.engine.generate import DEFAULT_DRAFTER, TEXT_DRAFTER

SAMPLE = str(Path(__file__).resolve().parents[2] / "world" / "assets" / "sample.png")
ASK = ["generate", "--image", SAMPLE, "--question", "Describe the image in detail.", "--threads", "1",
       "--max-tokens", "24"]


def _run(capsys, *extra: str) -> tuple[int, list[str], str]:
    rc = main(ASK + list(extra))
    out = capsys.readouterr()
    return rc, out.out.strip().splitlines(), out.err


def test_default_drafter_answers_as_plain_decoding_does_with_tau_and_speedup(capsys):
    rc, spec, _ = _run(capsys)
    assert rc == 0
    rc, plain, _ = _run(capsys, "--drafter", "none")
    assert rc == 0
    assert spec[0] == plain[0] and spec[0].strip()  # the answer, first line of both
    report = "\n".join(spec[1:])
    assert f"{DEFAULT_DRAFTER} drafter" in report and "tau " in report
    assert "speedup " in report and "x over plain decoding" in report and "same text" in report
    assert "tau " not in "\n".join(plain[1:]) and "speedup" not in "\n".join(plain[1:])
    assert "plain decoding:" in plain[1]


def test_a_question_without_images_drafts_with_the_text_drafter_unless_one_is_named(capsys):
    text = ["generate", "--question", "What is 2 times 4?", "--threads", "1", "--max-tokens", "16", "--json"]
    assert main(text) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert TEXT_DRAFTER != DEFAULT_DRAFTER and r["drafter"] == TEXT_DRAFTER and r["identical"] is True
    assert main(text + ["--drafter", DEFAULT_DRAFTER]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["drafter"] == DEFAULT_DRAFTER


def test_json_record_of_a_named_drafter(capsys):
    rc, lines, _ = _run(capsys, "--drafter", "ngram", "--json", "--repeats", "2")
    assert rc == 0
    r = json.loads(lines[-1])
    assert r["drafter"] == "ngram" and r["identical"] is True and r["tau"] >= 1.0
    assert r["speedup"] > 0 and r["plain"]["tokens_per_s"] > 0 and r["speculative"]["tokens_per_s"] > 0


def test_no_compare_skips_plain_decoding(capsys):
    rc, lines, _ = _run(capsys, "--drafter", "ngram", "--no-compare", "--json")
    assert rc == 0
    r = json.loads(lines[-1])
    assert r["plain"] is None and r["speedup"] is None and r["tau"] >= 1.0 and r["answer"]


def test_unknown_drafter_is_a_clear_error_listing_the_known_kinds(capsys):
    rc, _, err = _run(capsys, "--drafter", "no-such-drafter")
    assert rc == 2
    assert "unknown drafter 'no-such-drafter'" in err
    assert all(k in err for k in ("flash", "ngram", "eagle", "none"))


def test_parsing_the_flags_imports_no_torch():
    code = ("import argparse, sys\n"
            "from specula.runtime.engine.generate import add_generate_arguments\n"
            "p = argparse.ArgumentParser(); add_generate_arguments(p)\n"
            "a = p.parse_args(['--question', 'q', '--drafter', 'none'])\n"
            "assert a.drafter == 'none' and 'torch' not in sys.modules, sorted(sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_default_flags():
    p = argparse.ArgumentParser()
    from specula.runtime.engine.generate import add_generate_arguments

    add_generate_arguments(p)
    a = p.parse_args(["--question", "q"])
    assert a.drafter == DEFAULT_DRAFTER and a.gamma >= 1 and not a.no_compare
