"""Chart reading words: each bar's patches name its value (and the tallest bar "tallest"), each line point's marker
patch its ordinal, value and (the peak) "highest"; the encoder's word codes carry them with --chart-words, and a
resumed run that extends its vision stage with the flag retrains the tower and refits the projector on them."""

import json
import random
import re

import pytest
import torch

from specula.world import charts, scene
from specula.world.vocab import ORDINALS
from specula.training.target.batching import Encoder
from specula.training.target.cli import parse_config
from specula.training.target.chart_words import chart_reading_words
from specula.training.target.train import TrainConfig, train
from specula.training.target.word_codes import WordCodes


def _captions(kind: str, n: int):
    """Chart captions of ``kind``: their response lists every value."""
    out = []
    for i in range(400):
        s = charts.make(random.Random(f"chart-words/{i}"), "chart", "caption")
        if s.kind == f"chart_caption/{kind}":
            out.append(s)
        if len(out) == n:
            return out
    raise AssertionError(f"too few {kind} charts")


def test_every_bar_names_its_value_and_the_tallest_bar_is_marked():
    for s in _captions("bar", 20):
        values = dict(re.findall(r"(\w+) at (\d)", s.response))  # colour -> value, from the reference caption
        words = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
        best = max(int(v) for v in values.values())
        unique = sum(int(v) == best for v in values.values()) == 1
        for colour, value in values.items():
            bar = {words[t] for t, w in enumerate(s.patch_words[0]) if w == (colour, "bar")}
            tallest = unique and int(value) == best
            assert bar == {(colour, "bar", value) + (("tallest",) if tallest else ())}, (s.response, bar)
        changed = [t for t, w in enumerate(s.patch_words[0]) if words[t] != w]
        assert all(s.patch_words[0][t][1:2] == ("bar",) for t in changed)  # numbers and background are untouched


def test_every_line_point_names_its_ordinal_value_and_the_peak():
    for s in _captions("line", 12):
        values = re.findall(r"\d", s.response.split(":")[1])
        words = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
        points = sorted((w for w in words if w[1:2] == ("point",) and len(w) > 2), key=lambda w: ORDINALS.index(w[2]))
        peak = ORDINALS[[int(v) for v in values].index(max(int(v) for v in values))]
        assert [w[2:4] for w in points] == [(ORDINALS[i], values[i]) for i in range(5)], (s.response, points)
        assert [w[2] for w in points if "highest" in w] == [peak]  # line charts have a single peak


def test_pies_and_other_samples_are_unchanged():
    pie = _captions("pie", 1)[0]
    assert chart_reading_words(pie.kind, pie.patch_words[0], pie.images[0]) == pie.patch_words[0]
    s = scene.make(random.Random("chart-words/scene"), "vqa", "vqa")
    assert chart_reading_words(s.kind, s.patch_words[0], s.images[0]) == s.patch_words[0]


def test_the_encoder_codes_carry_the_words_only_with_the_flag(processor):
    codes = WordCodes(64, 0)
    s = _captions("bar", 1)[0]
    plain = Encoder(processor, codes=codes).encode(s)
    read = Encoder(processor, codes=codes, chart_words="parts").encode(s)
    words = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
    for t, (before, after) in enumerate(zip(s.patch_words[0], words)):
        assert torch.allclose(plain.patch_codes[0, t], codes.patch(before))
        assert torch.allclose(read.patch_codes[0, t], codes.patch(after))
    bar = next(t for t, w in enumerate(s.patch_words[0]) if w[1:2] == ("bar",))
    assert not torch.allclose(read.patch_codes[0, bar], plain.patch_codes[0, bar])
    value_id = Encoder(processor).word_id(words[bar][2])
    assert value_id >= 0 and value_id in read.patch_targets[0, bar].tolist()  # the word targets name the value too
    assert value_id not in plain.patch_targets[0, bar].tolist()
    assert torch.equal(read.patch_classes, plain.patch_classes)  # the dense heads keep the world's classes


def test_whole_charts_add_counts_the_largest_slice_and_the_trend():
    from specula.world.vocab import NUMBER_WORDS

    for kind in ("bar", "pie", "line"):
        for s in _captions(kind, 8):
            parts = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
            whole = chart_reading_words(s.kind, s.patch_words[0], s.images[0], "whole")
            added = {w[len(p):] for p, w in zip(parts, whole) if p != w}
            assert all(w[:len(p)] == p for p, w in zip(parts, whole))  # "whole" only appends
            if kind == "bar":
                k = len(re.findall(r"\w+ at \d", s.response))
                assert added == {(NUMBER_WORDS[k],)}  # on every bar
                assert all(w[-1] == NUMBER_WORDS[k] for w in whole if w[1:2] == ("bar",))
            elif kind == "pie":
                m = re.search(r"with (\w+) slices; the (\w+) slice", s.response)
                assert added == {(m.group(1),), (m.group(1), "largest")}
                assert {w[0] for w in whole if "largest" in w} == {m.group(2)}
            else:
                values = [int(v) for v in re.findall(r"\d", s.response.split(":")[1])]
                trend = () if values[-1] == values[0] else ("higher" if values[-1] > values[0] else "lower",)
                assert added == ({trend} if trend else set())
                assert all(w[2] == "fifth" for p, w in zip(parts, whole) if p != w)
    with pytest.raises(ValueError, match="chart words level"):
        chart_reading_words("chart/bar", (), None, "all")


def test_cli_flag(tmp_path):
    parse = lambda *a: parse_config(list(a))  # noqa: E731
    assert parse("--chart-words").chart_words == "parts" and parse("--chart-words", "whole").chart_words == "whole"
    assert parse().chart_words == ""
    with pytest.raises(ValueError, match="chart_words must be"):
        TrainConfig(chart_words="all")


@pytest.mark.slow
def test_a_resumed_run_extends_its_vision_stage_with_the_words_and_refits(tmp_path, processor, monkeypatch):
    base = dict(run_dir=str(tmp_path / "run"), arch="tiny", pool=8, token_budget=2048, warmup_samples=4, eval_n=2,
                eval_every_s=1e9, ckpt_every_s=1e9, threads=1, code_lm_samples=8, code_lm_layers=1,
                code_token_budget=2048, vision_images=8, projector_fit_images=8, freeze_vision=True, vis_weight=0.0,
                mix="scan_suites_charts", total_samples=8)
    quiet = lambda m: None  # noqa: E731
    ckpt = train(TrainConfig(**base), processor, log=quiet)
    from specula.training.target import chart_words

    levels = []
    read = chart_words.chart_reading_words

    def spy(kind, words, image, level="parts"):
        levels.append(level)
        return read(kind, words, image, level)

    monkeypatch.setattr(chart_words, "chart_reading_words", spy)
    logs = []
    ckpt = train(TrainConfig(**{**base, "vision_images": 24, "chart_words": "whole", "total_samples": 16}), processor,
                 log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["vision_images_done"] == 24 and state["samples"] >= 16
    assert any(re.match(r"vision stage: \d+ images", m) for m in logs), logs
    assert any(m.startswith("projector fit:") for m in logs), logs  # refitted after the extension
    assert state["projector_fit"]["at_samples"] >= 8
    assert levels and set(levels) == {"whole"}  # the run's encoder read the charts at the configured level
