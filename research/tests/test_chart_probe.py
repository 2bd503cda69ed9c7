"""``python -m research probe-charts``: each head's mass at bar-value answers, each chart target's mass, the command."""

import json

import pytest
import torch

from research.cli import main
from research.chart_probe import PARTS, head_masses, target_masses
from specula.training.target.chart_referents import NUMBER_HEAD, NUMBER_LAYER
from specula.targets.embedded_arch import TargetArch, build_model


@pytest.fixture(scope="module")
def tiny_deep(processor):
    torch.manual_seed(0)
    return build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval(), processor


def test_every_heads_mass_splits_over_the_four_parts(tiny_deep):
    model, processor = tiny_deep
    report = head_masses(model, processor, n=3)
    cfg = model.config.text_config
    assert report["n"] == 3 and report["parts"] == list(PARTS)
    assert [(r["layer"], r["head"]) for r in report["by_head"]] == [
        (layer, h) for layer in range(cfg.num_hidden_layers) for h in range(cfg.num_attention_heads)]
    for r in report["by_head"]:
        assert all(x >= -1e-4 for x in r["mass"]) and sum(r["mass"]) == pytest.approx(1.0, abs=1e-3)
    # a random LM spreads its mass: a one- or two-patch number gets far less than the whole image
    assert max(r["mass"][1] for r in report["by_head"]) < 0.5


def test_each_target_kind_reports_its_mass_and_trained_loss(tiny_deep):
    model, processor = tiny_deep
    hops = target_masses(model, processor, n=12)["hops"]
    assert f"bar number (layer {NUMBER_LAYER} head {NUMBER_HEAD})" in hops and "bar part (layer 1 head 0)" in hops
    assert "bar word (layer 0 head 0)" in hops and not any(k.startswith("line word") for k in hops)
    for v in hops.values():
        assert v["n"] > 0 and 0 <= v["min"] <= v["mean"] <= 1
        assert v["neg_log"] >= -1e-6


def test_the_command_writes_json_and_markdown(tiny_deep, tmp_path):
    model, processor = tiny_deep
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    assert main(["probe-charts", "--model", str(tmp_path / "m"), "--n", "2", "--threads", "1",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "probe_charts.json").read_text())
    assert report["model"] == str(tmp_path / "m") and report["heads"]["n"] == 2 and report["targets"]["hops"]
    md = (tmp_path / "out" / "probe_charts.md").read_text()
    assert "| layer | head | asked bar | its number | other image | text |" in md and "mean -log" in md
    assert set(report["words"]) == {"bar_value", "point_value", "point_ordinal", "tallest", "highest", "largest",
                                    "bar_count", "slice_count", "trend"}
    assert "| reading | n | accuracy |" in md
    with pytest.raises(SystemExit, match="--n must be at least 1"):
        main(["probe-charts", "--model", str(tmp_path / "m"), "--n", "0"])


def test_word_readout_reads_exact_codes_perfectly_and_a_random_tower_near_chance(tiny_deep, monkeypatch):
    import random

    from specula.world import charts
    from research import chart_word_probe
    from specula.training.target.chart_words import chart_reading_words
    from specula.training.target.word_codes import WordCodes

    model, processor = tiny_deep
    random_tower = chart_word_probe.word_readout(model, processor, n=30)
    assert set(random_tower) == set(chart_word_probe.READINGS)
    assert random_tower["bar_value"]["n"] > 20 and random_tower["bar_value"]["accuracy"] < 0.6
    codes = WordCodes(model.config.text_config.hidden_size, 0)
    exact = []
    for i in range(30):  # the probe's own draws, in its order: a tower that outputs their exact codes
        s = charts.make(random.Random(f"probe-chart-words/0/{i}"), "chart", "qa")
        exact.append(codes.images((chart_reading_words(s.kind, s.patch_words[0], s.images[0], "whole"),)))
    monkeypatch.setattr(chart_word_probe, "tower_features", lambda m, pixels: (None, exact.pop(0)))
    read = chart_word_probe.word_readout(model, processor, n=30)
    assert not exact and all(v["n"] > 0 and v["accuracy"] == 1.0 for v in read.values()), read
