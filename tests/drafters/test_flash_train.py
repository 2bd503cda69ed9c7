"""``specula train flash`` on a tiny random LLaVA target saved to a temporary directory: the recipe makes its data from
the target's own answers, lowers the loss, resumes exactly, exports fp16 weights that load back and draft through
the engine (image prompts, output unchanged). Nothing is written into the zoo."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from trainer_kit import (answer_requests, assert_drafts_like_plain, assert_export_loads, assert_loss_falls,
                         assert_resumes_exactly, save_lively_target, zoo_listing)

from specula.drafters import create
from specula.training.drafters.distill_data import load_answers
from specula.drafters.flash_head import FlashConfig, FlashHead, load_flash
from specula.training.drafters.flash import FlashTrainConfig, export_flash, flash_step, train, train_flash_cli
from specula.runtime.bench.spec import make_drafter
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "flash")


def config(tmp_path, target_dir, name: str, **kw) -> FlashTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=16, eval_samples=4,
                max_new_tokens=10, chunk=8, total_samples=64, pool=16, token_budget=4096, warmup_samples=8,
                lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9, tokens_per_pass=3, visual_tokens=16)
    return FlashTrainConfig(**{**base, **kw})


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    cfg = config(tmp_path, target_dir, "a")
    straight = config(tmp_path, target_dir, "b", data_dir=str(tmp_path / "a" / "data"))
    ckpt, a = assert_resumes_exactly(train, cfg, straight, 32)  # interrupted at 32, resumed
    assert {"queries", "offsets.0.weight", "offsets.2.bias"} <= a.keys()

    # the loss went down on the answers it trained on, images included
    target = load_target(target_dir)
    processor = load_processor(TOKENIZER_DIR)
    answers = load_answers(tmp_path / "a" / "data", "train", 16)
    image = target.info.image_token_id
    assert sum(bool((x.prompt == image).any()) for x in answers) >= 8
    torch.manual_seed(cfg.seed)
    head = FlashHead(FlashConfig.from_target(target, tokens_per_pass=3, visual_tokens=16))  # train()'s init
    head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    assert_loss_falls(head, a, target, processor, answers, cfg, step=flash_step)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 64 and state["history"][-1]["eval_tau_g4"] >= 1.0
    assert state["params"] == sum(p.numel() for p in head.parameters())

    # export (fp16) and load back, with the target (shared lm_head) and without
    out = export_flash(ckpt, tmp_path / "zoo" / "flash")
    info, _ = assert_export_loads(out, "flash", load_flash, target, a)
    assert info["tokens_per_pass"] == 3 and info["visual_tokens"] == 16

    # drafts through the engine from the exported directory on image prompts, output unchanged
    imgs = [x for x in answers if (x.prompt == image).any()][:3]
    reqs = answer_requests(processor, imgs, cfg.seed)
    d = create({"kind": "flash", "path": str(out)}, target=target)
    assert_drafts_like_plain(target_dir, target, d, reqs, 5, [processor.tokenizer.eos_token_id])

    # the benches hand their target to a flash drafter (the option comes through EAGLE's drafter): its head uses
    # that target's embedding and lm_head, not copies read from the checkpoint its record names
    b = make_drafter({"kind": "flash", "path": str(out)}, target)
    assert b.head._shared[0] is target.model.get_input_embeddings()
    assert b.head._shared[1] is target.model.get_output_embeddings()

    # loaded with no target in the process, a head whose record names its zoo's entry ("target", as in a candidate
    # zoo) reads the embedding of the target beside it, not of the shipped zoo's target of that name
    shutil.copytree(target_dir, tmp_path / "zoo" / "target")
    rec = json.loads((out / "specula.json").read_text())
    (out / "specula.json").write_text(json.dumps({**rec, "target": "target"}))
    alone = load_flash(out)
    assert torch.equal(alone._shared[0].weight, target.model.get_input_embeddings().weight.float())


def test_cli_trains_and_exports(tmp_path, target_dir):
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=6, samples=6,
                              max_new_tokens=6, seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9,
                              export=True, out=str(tmp_path / "out" / "flash"), tokens_per_pass=2, visual_tokens=4,
                              data_dir=None)
    zoo = zoo_listing()
    assert train_flash_cli(args) == 0
    cfg = json.loads((tmp_path / "out" / "flash" / "flash_config.json").read_text())
    assert cfg["tokens_per_pass"] == 2 and cfg["visual_tokens"] == 4 and cfg["image_tokens"] == 144
    assert zoo_listing() == zoo  # the zoo is untouched


def test_specula_train_flash_is_wired():
    from specula.cli import build_parser

    args = build_parser().parse_args(["train", "flash", "--tokens-per-pass", "3", "--visual-tokens", "32"])
    assert args.tokens_per_pass == 3 and args.visual_tokens == 32 and args.run_dir == "runs/flash" and args.func


@pytest.mark.parametrize("field,value", [("tokens_per_pass", 0), ("visual_tokens", 0), ("lr", 0.0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        FlashTrainConfig(**{field: value})
