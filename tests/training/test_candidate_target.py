"""The candidate zoo kept in the repository (not shipped): its target intact, loadable, and a continuation of
training; any drafter already retrained for it (a drafter build spans sessions, and runs/ does not survive one)
belongs to that target and names its entries."""

import json

import pytest

from specula.zoo.store import scan, verify
from specula.zoo.store import CANDIDATES_DIR, TARGET_DIR

CANDIDATE = CANDIDATES_DIR / "target"
pytestmark = pytest.mark.skipif(not (CANDIDATE / "config.json").exists(), reason="no candidate target in this checkout")


def test_candidate_matches_its_manifest_and_is_not_the_shipped_target():
    assert verify(CANDIDATES_DIR) == []
    entries = scan(CANDIDATES_DIR)["entries"]
    assert "target" in entries and "tokenizer" not in entries  # the tokenizer is the shipped one, unchanged
    shipped = scan(TARGET_DIR.parent)["entries"]["target"]
    assert entries["target"]["files"]["model.safetensors"]["sha256"] != shipped["files"]["model.safetensors"]["sha256"]


def test_candidate_loads_and_resumes_past_the_shipped_target():
    import torch
    from transformers import LlavaForConditionalGeneration

    from specula.targets.processor import load_processor

    info = json.loads((CANDIDATE / "specula.json").read_text())
    shipped = json.loads((TARGET_DIR / "specula.json").read_text())
    assert info["storage_dtype"] == "float16"
    assert info["trained_samples"] > shipped["trained_samples"]  # --init-from continues the count from here
    assert "vqa_exact_blank_image" in info["history"][-1]  # image-vs-blank tracked up to the export
    model = LlavaForConditionalGeneration.from_pretrained(str(CANDIDATE), dtype=torch.float32)
    processor = load_processor(CANDIDATE)
    assert model.config.text_config.num_hidden_layers >= 8
    assert model.config.image_seq_length >= 144
    assert len(processor.tokenizer) <= model.config.text_config.vocab_size


DRAFTERS = sorted(d.name for d in CANDIDATES_DIR.iterdir() if (d / "specula.json").exists() and d.name != "target") \
    if CANDIDATES_DIR.is_dir() else []


@pytest.mark.parametrize("name", DRAFTERS)
def test_candidate_drafters_belong_to_the_candidate_target(name):
    from specula.training.drafters.distill_data import target_fingerprint
    from specula.training.promote import drafter_problem, recipe_samples
    from specula.training.recipe import DRAFTERS as RECIPE

    step = {d.name: d for d in RECIPE}[name]
    assert drafter_problem(CANDIDATES_DIR / name, target_fingerprint(CANDIDATE), recipe_samples(step)) is None
    info = json.loads((CANDIDATES_DIR / name / "specula.json").read_text())
    refs = {info.get(k) for k in ("target", "distilled_from", "init_lm")} - {None}
    assert "target" in refs and refs <= set(scan(CANDIDATES_DIR)["entries"]), refs  # moves with the zoo
