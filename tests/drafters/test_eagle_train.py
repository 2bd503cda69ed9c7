"""``specula train eagle`` on a tiny random LLaVA target saved to a temporary directory: the recipe makes its data
from the target's own answers, lowers the loss, resumes exactly where it stopped, exports fp16 weights that load
back (with or without the target in the process) and draft through the engine. Nothing is written into the zoo."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from trainer_kit import (assert_drafts_like_plain, assert_export_loads, assert_loss_falls, assert_resumes_exactly,
                         save_lively_target, zoo_listing)

from specula.drafters import create
from specula.training.drafters.distill_data import cut_at_image_token, load_answers, make_answers, same_data
from specula.drafters.eagle_head import EagleConfig, EagleHead, load_eagle
from specula.training.drafters.eagle import EagleTrainConfig, export_eagle, train, train_eagle_cli
from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "eagle")


def config(tmp_path, target_dir, name: str, **kw) -> EagleTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=24, eval_samples=4,
                max_new_tokens=10, chunk=12, total_samples=96, pool=24, token_budget=4096, warmup_samples=8,
                lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9)
    return EagleTrainConfig(**{**base, **kw})


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    cfg = config(tmp_path, target_dir, "a")
    ckpt, a = assert_resumes_exactly(train, cfg, config(tmp_path, target_dir, "b"), 48)

    # the loss went down on the answers it trained on
    target = load_target(target_dir)
    processor = load_processor(TOKENIZER_DIR)
    answers = load_answers(tmp_path / "a" / "data", "train", 24)
    assert all(len(x.response) >= 1 for x in answers)
    torch.manual_seed(cfg.seed)
    head = EagleHead(EagleConfig.from_target(target))  # the init train() starts from
    head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    assert_loss_falls(head, a, target, processor, answers, cfg)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 96 and state["history"][-1]["eval_tau_g4"] >= 1.0

    # export (fp16) and load back: with the target (shared lm_head) and without (read from its checkpoint)
    out = export_eagle(ckpt, tmp_path / "zoo" / "eagle")
    info, _ = assert_export_loads(out, "eagle", load_eagle, target, a)
    assert info["trained_samples"] == 96 and info["target"] == str(target_dir)

    # and drafts through the engine from the exported directory, output unchanged
    reqs = [GenerationRequest(f"r{i}", a_.prompt, None, SamplingParams(max_tokens=8))
            for i, a_ in enumerate(answers) if not (a_.prompt == target.info.image_token_id).any()][:2]
    d = create({"kind": "eagle", "path": str(out), "structure": "tree"}, target=target)
    assert_drafts_like_plain(target_dir, target, d, reqs, 3, [processor.tokenizer.eos_token_id])


def test_cached_answers_belong_to_their_settings(tmp_path, target_dir):
    train(config(tmp_path, target_dir, "c", total_samples=24), log=lambda m: None)
    with pytest.raises(ValueError, match="holds answers made with"):
        train(config(tmp_path, target_dir, "c", total_samples=24, max_new_tokens=12), log=lambda m: None)


def test_cli_trains_and_exports(tmp_path, target_dir):
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=8, samples=16,
                              max_new_tokens=6, seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9,
                              export=True, out=str(tmp_path / "out" / "eagle"))
    zoo = zoo_listing()
    assert train_eagle_cli(args) == 0
    assert (tmp_path / "out" / "eagle" / "eagle.safetensors").exists()
    assert zoo_listing() == zoo  # the zoo is untouched


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("data_samples", 0), ("soft", 1.5), ("noise", -1.0),
                                         ("pool", True), ("eval_engine", 500), ("grad_clip", 0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EagleTrainConfig(**{field: value})


def test_cached_answers_follow_the_target_weights_not_its_folder(tmp_path):
    """A target copied to another folder (the candidate zoo, then the promoted one) keeps its cached answers; other
    weights, or a key without a fingerprint that names another folder, do not."""
    folder = tmp_path / "data"
    key = {"target": "runs/zoo-next/target", "target_sha256": "ab12"}
    make_answers(folder, None, None, key=key, n=0)
    make_answers(folder, None, None, key={**key, "target": "zoo/candidates/target"}, n=0)  # same weights: reused
    with pytest.raises(ValueError, match="holds answers made with"):
        make_answers(folder, None, None, key={**key, "target_sha256": "cd34"}, n=0)
    assert same_data({"target": "a", "x": 1}, {"target": "a", "x": 1})
    assert not same_data({"target": "a"}, {"target": "b"})  # no fingerprint: the folder is all that names it


def test_an_answer_stops_before_an_image_placeholder():
    """A target that writes the image token (an undertrained one, or sampling) leaves answers cut before it: every
    training forward would read it as an image slot with no features behind it."""
    r = torch.tensor([5, 6, 9, 7, 9])
    assert cut_at_image_token(r, 9).tolist() == [5, 6]
    assert cut_at_image_token(r, 4).tolist() == [5, 6, 9, 7, 9] and cut_at_image_token(r, None) is r
    assert cut_at_image_token(torch.tensor([9, 5]), 9).tolist() == []
