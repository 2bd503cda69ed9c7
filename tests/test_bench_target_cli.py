"""`specula bench target` on a small LLaVA saved to disk: JSON + markdown with the ratios asked for."""

import json

from transformers import AutoTokenizer

from specula.cli import main
from specula.targets.processor import build_processor
from specula.zoo.store import TOKENIZER_DIR
from specula.targets.embedded_arch import TargetArch, build_model


def test_bench_target_writes_json_and_markdown(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model_dir = tmp_path / "tiny"
    build_model(TargetArch.from_name("tiny"), tok).save_pretrained(model_dir)
    build_processor(tok).save_pretrained(model_dir)
    out = tmp_path / "bench"
    rc = main(["bench", "target", "--model", str(model_dir), "--out", str(out), "--max-gamma", "3", "--repeats", "2",
               "--threads", "1"])
    assert rc == 0
    r = json.loads((out / "bench_target.json").read_text())
    text = json.dumps(r)
    for key in ("decode", "verify", "prefill"):
        assert key in text
    assert r["machine"]["torch_threads"] == 1
    assert (out / "bench_target.md").read_text().strip()


def test_bench_spec_writes_report_and_checks_exactness(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model_dir = tmp_path / "tiny"
    build_model(TargetArch.from_name("tiny"), tok).save_pretrained(model_dir)
    build_processor(tok).save_pretrained(model_dir)
    out = tmp_path / "spec"
    rc = main(["bench", "spec", "--model", str(model_dir), "--out", str(out), "--suite", "vqa", "--suite", "text",
               "--n", "2", "--max-tokens", "8", "--gamma", "2", "--gamma", "4", "--drafter", "ngram",
               "--drafter", '{"kind": "random", "peaked": 2.0}', "--threads", "1"])
    assert rc == 0
    r = json.loads((out / "bench_spec.json").read_text())
    assert set(r["configs"]) >= {"plain", "hf", "ngram@2", "ngram@4", "random@2", "random@4"}
    for name, c in r["configs"].items():
        if "@" in name:
            assert c["greedy_exact"] is True and c["tau"] >= 1.0 and c["speedup_vs_plain"] > 0
    assert "no text_lm drafter" in r["hf_assisted_note"]
    # the draft-cost table: each drafter's time per block against plain decoding's time per step, from the JSON
    md = (out / "bench_spec.md").read_text()
    assert "## draft cost per block" in md
    plain = r["configs"]["plain"]
    t_decode = plain["time_split_s"]["verify"] / plain["blocks"]
    for name in ("ngram@2", "random@4"):
        c = r["configs"][name]
        row = next(x for x in md.splitlines() if x.startswith(f"| {name} | {c['blocks']} | "))
        assert f"| {c['time_split_s']['draft'] / c['blocks'] / t_decode:.2f} |" in row
    for f in ("bench_spec.md", "tau_per_suite.png", "alpha_n.png", "speedup_vs_gamma.png"):
        assert (out / f).stat().st_size > 0


def test_bench_spec_refuses_two_drafter_configs_under_one_name(tmp_path, capsys):
    """Two configs of one kind would share a row name and overwrite each other's figures: refused before any model
    loads, with the way out (a label) in the message."""
    rc = main(["bench", "spec", "--model", str(tmp_path / "never-loaded"), "--out", str(tmp_path / "spec"),
               "--drafter", "ngram", "--drafter", '{"kind": "ngram", "max_n": 3}', "--threads", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "['ngram']" in err and "label" in err
    assert not (tmp_path / "spec").exists()
