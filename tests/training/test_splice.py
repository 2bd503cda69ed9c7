"""``specula zoo splice``: one run's LM under other weights' vision tower and projector, resumable with a frozen
vision side."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlavaForConditionalGeneration

from specula.targets.processor import load_processor
from specula.training.build import export
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.splice import VISION_PREFIXES, splice
from specula.training.target.train import TrainConfig, train

BASE = dict(arch="tiny", pool=8, token_budget=2048, warmup_samples=4, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9,
            threads=1, code_lm_samples=8, code_lm_layers=1, code_token_budget=2048, vision_images=8,
            projector_fit_images=8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short runs from different seeds: ``a``'s checkpoint and ``b`` exported (the donor of the vision side)."""
    root = tmp_path_factory.mktemp("splice")
    processor = load_processor(TOKENIZER_DIR)
    quiet = lambda m: None  # noqa: E731
    a = train(TrainConfig(run_dir=str(root / "a"), total_samples=8, seed=0, **BASE), processor, log=quiet)
    b = train(TrainConfig(run_dir=str(root / "b"), total_samples=8, seed=1, **BASE), processor, log=quiet)
    return root, processor, a, export(b, root / "zoo" / "target")


def test_splice_takes_the_vision_side_from_the_donor_and_keeps_the_rest(runs):
    from specula.cli import main

    root, _, a, donor = runs
    out = root / "spliced" / "ckpt"
    assert main(["zoo", "splice", "--ckpt", str(a), "--vision-from", str(donor), "--out", str(out)]) == 0
    got, mine = load_file(out / "model.safetensors"), load_file(a / "model.safetensors")
    theirs = LlavaForConditionalGeneration.from_pretrained(str(donor), dtype=torch.float32).state_dict()
    vision = [k for k in got if k.startswith(VISION_PREFIXES)]
    assert all(any(k.startswith(prefix) for k in vision) for prefix in VISION_PREFIXES)  # tower and projector
    assert all(torch.equal(got[k], theirs[k]) for k in vision)
    assert any(not torch.equal(got[k], mine[k]) for k in vision)  # the seeds differ: the vision side did change
    assert all(torch.equal(got[k], mine[k]) for k in got if k not in vision)  # LM, embeddings: the run's own
    state, before = json.loads((out / "state.json").read_text()), json.loads((a / "state.json").read_text())
    assert state["samples"] == before["samples"]
    assert state["splices"] == [{"lm_from": str(a), "vision_from": str(donor), "at_samples": before["samples"]}]
    assert {p.name for p in a.iterdir()} == {p.name for p in out.iterdir()}  # optimizers and heads come along
    assert splice(out, a, root / "back" / "ckpt") == len(vision)  # a checkpoint can be the donor too
    assert all(torch.equal(load_file(root / "back" / "ckpt" / "model.safetensors")[k], mine[k]) for k in vision)


def test_a_spliced_checkpoint_resumes_with_its_vision_side_frozen(runs):
    root, processor, a, donor = runs
    out = root / "resume" / "ckpt"
    splice(a, donor, out)
    start = load_file(out / "model.safetensors")
    cfg = TrainConfig(run_dir=str(out.parent), total_samples=16, seed=0, freeze_vision=True, **BASE)
    ckpt = train(cfg, processor, log=lambda m: None)
    after = load_file(ckpt / "model.safetensors")
    assert json.loads((ckpt / "state.json").read_text())["samples"] >= 16
    assert all(torch.equal(after[k], start[k]) for k in after if k.startswith(VISION_PREFIXES))
    assert any(not torch.equal(after[k], start[k]) for k in after if ".language_model." in k)


def test_splice_refuses_what_it_cannot_splice(runs, tmp_path):
    root, _, a, donor = runs
    with pytest.raises(FileExistsError):
        splice(a, donor, a)
    with pytest.raises(FileNotFoundError, match="not a training checkpoint"):
        splice(tmp_path, donor, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="neither"):
        splice(a, tmp_path, tmp_path / "x")
    bad = tmp_path / "bad"
    bad.mkdir()
    sd = load_file(a / "model.safetensors")
    k = next(k for k in sd if k.startswith(VISION_PREFIXES[1]))
    sd[k] = torch.zeros(3, 3)
    save_file(sd, bad / "model.safetensors")
    (bad / "state.json").write_text("{}")
    with pytest.raises(ValueError, match="shape"):
        splice(a, bad, tmp_path / "y")
    assert not (tmp_path / "y").exists() and not (tmp_path / "x").exists()
