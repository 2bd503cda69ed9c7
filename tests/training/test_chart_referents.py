"""Chart referents: a chart question about one part of the chart gets the scene lookup's two hops and a hop onto the
part's number (targets parsed from chart questions and dialogues, the questions that get none, the loss group and its
wiring, the CLI flag and the depth refusal)."""

import json
import random

import pytest
import torch

from loss_kit import assert_own_term_reaching_layer0

from specula.world import charts
from specula.world.sample import GRID, PATCH
from specula.world.scene import make_dialogue
from specula.world.vocab import ORDINALS
from specula.training.target.batching import Encoder
from specula.training.target.cli import parse_config
from specula.training.target.chart_referents import NUMBER_HEAD, NUMBER_LAYER, chart_referent_targets, point_patches
from specula.training.target.referents import HEAD, PATCH_LAYER, WORD_LAYER
from specula.training.target.train import TrainConfig, train


@pytest.fixture(scope="module")
def enc(processor):
    return Encoder(processor, chart_referents=True)


def _chart(kind: str, seed: int, dialogue: bool = False):
    make = charts.make_dialogue if dialogue else charts.make
    return next(s for s in (make(random.Random(f"chart-ref/{seed}/{i}"), "chart", "qa") for i in range(300))
                if s.kind == kind)


def _turns(s):
    return [(s.prompt.replace("<image>", ""), s.response)] + list(s.followups)


def _targets(e):
    return [t for t in e.referents if t.group == "chart"]


def _patch_words_at(s, e, enc, t):
    """The patch words under a target's image tokens."""
    image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
    return [s.patch_words[0][image_pos.index(p)] for p in t.patches], [image_pos.index(p) for p in t.patches]


def _ordinal(q: str) -> int:
    return next(k for k, o in enumerate(ORDINALS) if f"the {o} point" in q)


def _answer_after(processor, e, t) -> str:
    return processor.tokenizer.decode(e.input_ids[t.query + 1: t.query + 2]).strip()


def _number_hops(e):
    return [t for t in _targets(e) if (t.patch_layer, t.head) == (NUMBER_LAYER, NUMBER_HEAD)]


def test_a_bar_value_question_looks_up_the_bar_by_colour_and_then_the_number_above_it(processor, enc):
    for seed in range(6):
        s = _chart("chart_dialogue/bar", seed, dialogue=True)
        e = enc.encode(s)
        values = [(q, a) for q, a in _turns(s) if "bar" in q and a.isdigit()]
        got, numbers = [t for t in _targets(e) if t.words], _number_hops(e)
        assert len(got) == len(numbers) == len(values) > 0
        for t, n, (q, a) in zip(got, numbers, values):
            assert (t.patch_layer, t.word_layer, t.head) == (PATCH_LAYER, WORD_LAYER, HEAD)
            assert n.query == t.query and n.words == ()
            assert _answer_after(processor, e, t) == a  # the query predicts the value
            colour = next(c for c in charts.CHART_COLOURS if f" {c} bar" in q)
            assert [processor.tokenizer.decode([int(e.input_ids[w])]).strip() for w in t.words] == [colour]
            assert max(t.words) < t.query and min(t.patches) < min(t.words)
            assert set(_patch_words_at(s, e, enc, t)[0]) == {(colour, "bar")}  # the lookup lands on the bar
            words, idx = _patch_words_at(s, e, enc, n)
            assert set(words) == {(a,)}  # the number hop on the number printed above that bar, nothing else
            bar_cols = {p % GRID for p, w in enumerate(s.patch_words[0]) if w == (colour, "bar")}
            assert {p % GRID for p in idx} <= bar_cols


def test_a_point_value_question_looks_up_the_ordinal_and_that_points_marker(processor, enc):
    n = 0
    for seed in range(10):
        s = _chart("chart_dialogue/line", seed, dialogue=True)
        e = enc.encode(s)
        values = [(q, a) for q, a in _turns(s) if "point?" in q and "value" in q
                  and point_patches(s.patch_words[0], _ordinal(q), label=False)]  # a marker under a patch's quarter: none
        got = [t for t in _targets(e) if (t.patch_layer, t.head) == (PATCH_LAYER, HEAD) and _answer_after(
            processor, e, t).isdigit()]
        assert len(got) == len(values)
        for t, (q, a) in zip(got, values):
            i = _ordinal(q)
            assert _answer_after(processor, e, t) == a and t.words == ()  # no word hop on an ordinal
            words, idx = _patch_words_at(s, e, enc, t)
            assert words and all(w[1:] == ("point",) for w in words)  # the lookup lands on the point's marker
            assert all(abs(p % GRID - int(charts.LINE_XS[i] // PATCH)) <= 1 for p in idx)
            for h in (h for h in _number_hops(e) if h.query == t.query):  # the number, when it covers a patch
                assert set(_patch_words_at(s, e, enc, h)[0]) == {(a,)}
            n += 1
    assert n > 5


def test_superlatives_look_at_the_answers_part_without_a_word_hop(processor, enc):
    for kind, part in (("chart/bar", "bar"), ("chart/pie", "slice"), ("chart/line", "point")):
        found = 0
        for seed in range(40):
            s = _chart(kind, seed)
            q = s.prompt.lower()
            if not any(w in q for w in ("tallest", "highest", "peak", "largest", "biggest")):
                continue
            e = enc.encode(s)
            (t,) = _targets(e)  # the lookup alone: no word, no number
            assert t.words == () and _answer_after(processor, e, t) == s.response
            words, idx = _patch_words_at(s, e, enc, t)
            if part == "point":
                assert all(w[1] == "point" for w in words)
                i = ORDINALS.index(s.response)
                assert all(abs(p % GRID - int(charts.LINE_XS[i] // PATCH)) <= 1 for p in idx)
            else:
                assert set(words) == {(s.response, part)}
            found += 1
            if found == 2:
                break
        assert found == 2, kind


def test_with_reading_words_a_value_is_the_lookup_alone_onto_the_part_that_names_it(processor):
    from specula.training.target.chart_words import chart_reading_words

    enc = Encoder(processor, chart_referents=True, chart_words="parts")
    kinds = set()
    for kind in ("chart_dialogue/bar", "chart_dialogue/line"):
        for seed in range(6):
            s = _chart(kind, seed, dialogue=True)
            e = enc.encode(s)
            reading = chart_reading_words(s.kind, s.patch_words[0], s.images[0])
            image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
            assert _targets(e) and not _number_hops(e)  # no hop onto the printed number
            for t in _targets(e):
                answer = _answer_after(processor, e, t)
                words = {reading[image_pos.index(p)] for p in t.patches}
                assert all(answer in w for w in words), (answer, words)  # the part's own words carry the answer
                if kind.endswith("line"):  # one marker patch, also where the marker covers under a quarter of it
                    assert len(t.patches) == 1 and next(iter(words))[1] == "point"
                kinds.add((kind, answer.isdigit()))
    assert kinds == {(k, d) for k in ("chart_dialogue/bar", "chart_dialogue/line") for d in (True, False)}


def test_with_whole_chart_words_counts_and_trends_look_at_the_parts_that_name_them(processor):
    from specula.training.target.chart_words import chart_reading_words

    enc = Encoder(processor, chart_referents=True, chart_words="whole")
    seen = set()
    for kind in ("chart_dialogue/bar", "chart_dialogue/pie", "chart_dialogue/line"):
        for seed in range(8):
            s = _chart(kind, seed, dialogue=True)
            e = enc.encode(s)
            reading = chart_reading_words(s.kind, s.patch_words[0], s.images[0], "whole")
            image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
            for t in _targets(e):
                answer = _answer_after(processor, e, t)
                words = [reading[image_pos.index(p)] for p in t.patches]
                assert all(answer in w for w in words), (answer, words)
                if answer in ("higher", "lower"):
                    assert len(words) == 1 and words[0][2] == "fifth"  # the trend: the last point
                    seen.add("trend")
                elif answer in ("two", "three", "four", "five"):  # a count: every bar or slice
                    part = "bar" if kind.endswith("bar") else "slice"
                    assert len(t.patches) == sum(w[1:2] == (part,) for w in reading)
                    seen.add(f"{part} count")
    assert seen == {"trend", "bar count", "slice count"}


def test_comparisons_counts_trends_and_other_samples_get_no_chart_targets(processor, enc):
    none = 0
    for seed in range(40):
        s = charts.make(random.Random(f"chart-ref/none/{seed}"), "chart", "qa")
        q = s.prompt.lower()
        if any(w in q for w in ("taller than", "how many", "higher or lower")):
            assert _targets(enc.encode(s)) == []
            none += 1
    assert none > 5
    rng = random.Random("chart-ref/other")
    for s in (make_dialogue(rng, "vqa_dialogue", "vqa"), charts.make(rng, "chart", "caption")):
        assert _targets(enc.encode(s)) == []
    s = _chart("chart/bar", 0)
    assert chart_referent_targets(s, torch.zeros(8, dtype=torch.long), torch.full((8,), -100), enc.image_id,
                                  enc.word_id) == ()
    assert _targets(Encoder(processor).encode(_chart("chart_dialogue/bar", 0, dialogue=True))) == []  # off by default


def test_the_chart_term_is_its_own_loss_and_reaches_the_first_layer(processor, enc):
    assert_own_term_reaching_layer0(processor.tokenizer, [enc.encode(_chart("chart_dialogue/bar", 0, dialogue=True)),
                                                         enc.encode(_chart("chart/pie", 0))], "chart_referents", "chart_referent")


def test_the_flag_reaches_the_config_and_a_run_trains_the_term(processor, tmp_path):
    cfg = parse_config(["--chart-referents", "2"])
    assert cfg.chart_referents == 2.0
    assert parse_config([]).chart_referents == 0.0
    with pytest.raises(ValueError, match="chart_referents must be >= 0"):
        TrainConfig(chart_referents=-1.0)
    base = dict(total_samples=48, pool=16, token_budget=4096, warmup_samples=2, eval_n=2, eval_every_s=0.0,
                ckpt_every_s=1e9, threads=1, vision_images=8, mix="scan_suites")
    refused = r"LM deeper than layer 3 \(the chart number hop \(training/target/chart_referents.py\)\); arch 'tiny' has 2 layers"
    with pytest.raises(ValueError, match=refused):
        train(TrainConfig(run_dir=str(tmp_path / "tiny"), arch="tiny", chart_referents=1.0, **base), processor,
              log=lambda *a: None)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny_deep", chart_referents=1.0, **base), processor,
                 log=lambda *a: None)
    history = json.loads((ckpt / "state.json").read_text())["history"]
    assert any(h.get("loss_chart_referent", 0) > 0 for h in history)
