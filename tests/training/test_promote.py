"""`specula zoo promote`: the candidate zoo ships only whole (every recipe drafter retrained on its target)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specula.training.drafters.distill_data import target_fingerprint
from specula.zoo.store import scan, verify
from specula.training.promote import missing, promote, recipe_samples
from specula.training.recipe import DRAFTERS


def _entry(d, files: dict):
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)


@pytest.fixture
def zoos(tmp_path):
    """A shipped zoo (old target, tokenizer, old drafters) and a candidate zoo (new target, drafters on it)."""
    shipped, cand = tmp_path / "weights", tmp_path / "candidates"
    for z, value in ((shipped, 0.0), (cand, 1.0)):
        _entry(z / "target", {"config.json": "{}"})
        save_file({"w": torch.full((2,), value)}, str(z / "target" / "model.safetensors"))
    _entry(shipped / "tokenizer", {"tokenizer.json": "{}"})
    for z in (shipped, cand):
        sha = target_fingerprint(z / "target")
        for d in DRAFTERS:
            _entry(z / d.name, {"specula.json": json.dumps({"target": "target", "target_sha256": sha,
                                                            "trained_samples": recipe_samples(d)})})
    return shipped, cand


def test_promote_moves_the_candidates_and_rewrites_the_manifest(zoos):
    shipped, cand = zoos
    new_sha = target_fingerprint(cand / "target")
    assert missing(cand) == []
    names = promote(cand, shipped)
    assert set(names) == {"target"} | {d.name for d in DRAFTERS}
    assert not cand.exists()
    assert target_fingerprint(shipped / "target") == new_sha
    assert all(json.loads((shipped / d.name / "specula.json").read_text())["target_sha256"] == new_sha
               for d in DRAFTERS)
    assert "tokenizer" in scan(shipped)["entries"] and verify(shipped) == []


def test_promote_refuses_an_incomplete_candidate_zoo_and_moves_nothing(zoos, capsys):
    from specula.cli import main

    shipped, cand = zoos
    old = scan(shipped)
    meta = cand / "eagle" / "specula.json"
    meta.write_text(json.dumps({"target": "target", "target_sha256": "0" * 64}))
    (cand / "aasd" / "specula.json").unlink()
    short = json.loads((cand / "msd" / "specula.json").read_text())  # a small-scale build's drafter
    (cand / "msd" / "specula.json").write_text(json.dumps({**short, "trained_samples": 40}))
    assert sorted(missing(cand)) == ["aasd: not retrained yet", "eagle: trained on another target",
                                     "msd: trained on 40 samples, the recipe's are 36000"]
    with pytest.raises(ValueError, match="not complete"):
        promote(cand, shipped)
    assert scan(shipped) == old and (cand / "target").exists()
    assert main(["zoo", "promote", "--candidates", str(cand), "--zoo-dir", str(shipped), "--check"]) == 1
    assert "aasd: not retrained yet" in capsys.readouterr().out
    assert main(["zoo", "promote", "--candidates", str(cand), "--zoo-dir", str(shipped)]) == 1
    assert scan(shipped) == old
    assert missing(cand.parent / "nowhere") == [f"{cand.parent / 'nowhere' / 'target'}: no target"]
