"""Issue 4's quality gates, read off the shipped target on a held-out sample (the first 200 VQA questions and 100
captions of the world's eval split; deterministic for given weights): each gate asserted at its threshold.

The sample is large enough that the shipped target's figures there (VQA 0.93 with 0.255 blank, captions 0.908 with
0.082 blank; the targets shipped before read 0.915 / 0.862 and 0.91 / 0.872) sit on the same side of the gates as on
the 300 of docs/embedded-model.md; on a sample of 60 questions / 40 captions they could fall within one standard
error under a gate.
A few minutes on one thread."""

import pytest

from specula.zoo.store import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").exists(), reason="no shipped target in this checkout")


@pytest.fixture(scope="module")
def report():
    import torch

    from specula.training.target.evaluate import evaluate, load_model

    torch.set_num_threads(1)
    model, processor = load_model(str(TARGET_DIR))
    vqa = evaluate(model, processor, n=200, suites=["vqa"], forms=())  # the gates: image-first prompts
    cap = evaluate(model, processor, n=100, suites=["caption"])
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


def test_vqa_gate(report):
    assert report[0]["gates"]["vqa_exact"], report[0]["vqa_exact"]  # >= 0.90


def test_caption_gate(report):
    assert report[1]["gates"]["caption_attribute_recall"], report[1]["suites"]["caption"]  # >= 0.85
