"""Issue 4's ungated suites, read off the shipped target on a held-out sample (the first 100 samples of each; the
same questions with every image gray): charts, OCR, image sets and clips each far above their blank-image accuracy.

"Far above" as asserted here: at least 0.15 above blank and at least twice blank. The shipped target's figures on
these samples (`specula zoo eval --suites S --n 100`): charts 0.66 vs 0.30, OCR 0.28 vs 0.02, image sets 0.64 vs
0.18, video 0.97 vs 0.22; the target shipped before it failed the image sets (0.56 vs 0.37). A few minutes on one
thread."""

import pytest

from specula.zoo.store import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").exists(), reason="no shipped target in this checkout")

SUITES = ("chart", "ocr", "multi_image", "video")


@pytest.fixture(scope="module")
def report():
    import torch

    from specula.training.target.evaluate import evaluate, load_model

    torch.set_num_threads(1)
    model, processor = load_model(str(TARGET_DIR))
    return evaluate(model, processor, n=100, suites=list(SUITES))["suites"]


@pytest.mark.parametrize("suite", SUITES)
def test_suite_reads_the_image_far_above_blank(report, suite):
    r = report[suite]
    assert r["exact"] >= r["exact_blank_image"] + 0.15, r
    assert r["exact"] >= 2 * r["exact_blank_image"], r
