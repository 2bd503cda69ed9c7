"""Issue 4's quality gates, read off the shipped target on a small held-out sample (the first 60 VQA questions and
40 captions of the world's eval split; deterministic for given weights).

What passes is asserted; what the shipped weights do not reach yet is a strict xfail, so meeting a gate turns
the test red until the gate is asserted for real (the full figures on 300 questions are in the README)."""

import pytest

from specula.zoo.paths import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").exists(), reason="no shipped target in this checkout")


@pytest.fixture(scope="module")
def report():
    import torch

    from specula.zoo.evaluate import evaluate, load_model

    torch.set_num_threads(1)
    model, processor = load_model(str(TARGET_DIR))
    vqa = evaluate(model, processor, n=60, suites=["vqa"])
    cap = evaluate(model, processor, n=40, suites=["caption"])
    return vqa, cap


def test_the_target_answers_from_the_image_not_from_priors(report):
    vqa, _ = report
    assert vqa["gates"]["vqa_blank_near_chance"]  # blank image <= chance + 10 points
    assert vqa["vqa_exact"] >= vqa["vqa_exact_blank_image"] + 0.40  # the image carries the answer
    assert vqa["vqa_exact"] >= 0.80


def test_captions_name_what_is_in_the_image(report):
    _, cap = report
    c = cap["suites"]["caption"]
    assert c["caption_attribute_recall"] >= c["caption_attribute_recall_blank_image"] + 0.40
    assert c["caption_attribute_recall"] >= 0.60


@pytest.mark.xfail(strict=True, reason="issue 4 open: the shipped target is at ~0.89 VQA on 300 questions")
def test_vqa_gate(report):
    assert report[0]["gates"]["vqa_exact"]  # >= 0.90


@pytest.mark.xfail(strict=True, reason="issue 4 open: the shipped target's captions recall ~0.70 of attributes")
def test_caption_gate(report):
    assert report[1]["gates"]["caption_attribute_recall"]  # >= 0.85
