"""The shipped zoo: files match the manifest, the target loads from its directory and answers about the sample."""

import json
from pathlib import Path

import pytest

from specula.zoo.store import scan, verify
from specula.zoo.store import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").exists(), reason="no shipped target in this checkout")


def test_manifest_matches_the_files_and_budget():
    assert verify() == []
    assert scan()["total_bytes"] <= 150 * 2**20  # the whole shipped zoo stays within 150 MB


def test_shipped_target_shape_and_training_record():
    cfg = json.loads((TARGET_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llava"
    assert cfg["text_config"]["num_hidden_layers"] >= 8
    assert cfg["image_seq_length"] >= 144
    info = json.loads((TARGET_DIR / "specula.json").read_text())
    assert info["trained_samples"] > 0 and info["history"]
    # image-vs-blank tracked during training: the code LM stage reads exact codes vs zero codes, later checks the
    # tower's tokens vs a blank image
    assert all("vqa_exact_blank_image" in h or "code_vqa_exact_blank" in h for h in info["history"])
    assert "vqa_exact_blank_image" in info["history"][-1]


def test_generate_answers_about_the_sample_image(capsys):
    from specula.cli import main
    from specula.runtime.engine.generate import DEFAULT_DRAFTER

    sample = Path(__file__).resolve().parents[2] / "world" / "assets" / "sample.png"
    rc = main(["generate", "--image", str(sample), "--question", "What colour is the star?",
               "--max-tokens", "4", "--threads", "1", "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["new_tokens"] >= 1 and isinstance(rec["answer"], str)
    assert rec["drafter"] == DEFAULT_DRAFTER and rec["identical"] is True  # speculative by default, checked against plain
    assert rec["speculative"]["tokens_per_s"] > 0 and rec["plain"]["tokens_per_s"] > 0 and rec["speedup"] > 0
    assert rec["prompt_tokens"] > 144
