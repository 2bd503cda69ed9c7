"""``specula train flash`` on a tiny random LLaVA target saved to a temporary directory: the recipe makes its data from
the target's own answers, lowers the loss, resumes exactly, exports fp16 weights that load back and draft through
the engine (image prompts, output unchanged). Nothing is written into the zoo."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from specula.drafters import create
from specula.drafters.distill_data import load_answers, pixels
from specula.drafters.flash_head import FlashConfig, FlashHead, load_flash
from specula.drafters.train_eagle import evaluate
from specula.drafters.train_flash import FlashTrainConfig, export_flash, flash_step, train, train_flash_cli
from specula.runtime.engine import GenerationRequest, SpecEngine
from specula.runtime.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.paths import TOKENIZER_DIR, ZOO_DIR
from specula.zoo.target_config import TargetArch, build_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    processor = load_processor(TOKENIZER_DIR)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger weights than the init: answers vary instead of repeating one token
        for p in model.model.language_model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    d = tmp_path_factory.mktemp("flash") / "target"
    model.save_pretrained(d)
    return d


def config(tmp_path, target_dir, name: str, **kw) -> FlashTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=16, eval_samples=4,
                max_new_tokens=10, chunk=8, total_samples=64, pool=16, token_budget=4096, warmup_samples=8,
                lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9, tokens_per_pass=3, visual_tokens=16)
    return FlashTrainConfig(**{**base, **kw})


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    logs: list[str] = []
    cfg = config(tmp_path, target_dir, "a")
    ckpt = train(cfg, log=logs.append, stop_at=32)  # an interrupted run
    assert json.loads((ckpt / "state.json").read_text())["samples"] == 32
    train(cfg, log=logs.append)  # resumes
    assert any("resumed from" in m for m in logs) and any("already in" in m for m in logs)
    straight = train(config(tmp_path, target_dir, "b", data_dir=str(tmp_path / "a" / "data")), log=lambda m: None)
    a, b = load_file(ckpt / "head.safetensors"), load_file(straight / "head.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
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
    before = evaluate(head, target, processor, answers, cfg, step=flash_step)
    head.load_state_dict(a)
    after = evaluate(head, target, processor, answers, cfg, step=flash_step)
    assert after["eval_feat"] < 0.9 * before["eval_feat"] and after["eval_hard"] < before["eval_hard"]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 64 and state["history"][-1]["eval_tau_g4"] >= 1.0
    assert state["params"] == sum(p.numel() for p in head.parameters())

    # export (fp16) and load back, with the target (shared lm_head) and without
    out = export_flash(ckpt, tmp_path / "zoo" / "flash")
    assert sorted(p.name for p in out.iterdir()) == ["flash.safetensors", "flash_config.json", "specula.json"]
    assert not (tmp_path / "zoo" / "manifest.json").exists()
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "flash" and info["tokens_per_pass"] == 3 and info["visual_tokens"] == 16
    assert all(v.dtype == torch.float16 for v in load_file(out / "flash.safetensors").values())
    assert (out / "flash.safetensors").stat().st_size < 2 * 1.1 * info["params"]
    loaded = load_flash(out, target)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, a[k], atol=2e-3, rtol=2e-3)
    assert loaded._shared[1] is target.model.get_output_embeddings()
    x = torch.randn(3, loaded.config.hidden_size)
    torch.testing.assert_close(load_flash(out).logits(x), loaded.logits(x))

    # drafts through the engine from the exported directory on image prompts, output unchanged
    imgs = [x for x in answers if (x.prompt == image).any()][:3]
    reqs = [GenerationRequest(f"r{i}", x.prompt, pixels(processor, x, cfg.seed), SamplingParams(max_tokens=8))
            for i, x in enumerate(imgs)]
    eos = [processor.tokenizer.eos_token_id]
    ref = SpecEngine(load_target(target_dir), None, eos_token_ids=eos).generate(reqs)
    d = create({"kind": "flash", "path": str(out)}, target=target)
    got = SpecEngine(target, d, gamma=5, eos_token_ids=eos).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in ref.items()}


def test_cli_trains_and_exports(tmp_path, target_dir):
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=6, samples=6,
                              max_new_tokens=6, seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9,
                              export=True, out=str(tmp_path / "out" / "flash"), tokens_per_pass=2, visual_tokens=4,
                              data_dir=None)
    zoo = sorted(p.name for p in ZOO_DIR.iterdir()) if ZOO_DIR.is_dir() else []
    assert train_flash_cli(args) == 0
    cfg = json.loads((tmp_path / "out" / "flash" / "flash_config.json").read_text())
    assert cfg["tokens_per_pass"] == 2 and cfg["visual_tokens"] == 4 and cfg["image_tokens"] == 144
    assert (sorted(p.name for p in ZOO_DIR.iterdir()) if ZOO_DIR.is_dir() else []) == zoo  # the zoo is untouched


def test_specula_train_flash_is_wired():
    from specula.cli import build_parser

    args = build_parser().parse_args(["train", "flash", "--tokens-per-pass", "3", "--visual-tokens", "32"])
    assert args.tokens_per_pass == 3 and args.visual_tokens == 32 and args.run_dir == "runs/flash" and args.func


@pytest.mark.parametrize("field,value", [("tokens_per_pass", 0), ("visual_tokens", 0), ("lr", 0.0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        FlashTrainConfig(**{field: value})
