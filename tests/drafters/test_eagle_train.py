"""``specula train eagle`` on a tiny random LLaVA target saved to a temporary directory: the recipe makes its data
from the target's own answers, lowers the loss, resumes exactly where it stopped, exports fp16 weights that load
back (with or without the target in the process) and draft through the engine. Nothing is written into the zoo."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from specula.drafters import create
from specula.drafters.distill_data import load_answers
from specula.drafters.eagle_head import EagleConfig, EagleHead, load_eagle
from specula.drafters.train_eagle import EagleTrainConfig, evaluate, export_eagle, train, train_eagle_cli
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
    d = tmp_path_factory.mktemp("eagle") / "target"
    model.save_pretrained(d)
    return d


def config(tmp_path, target_dir, name: str, **kw) -> EagleTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=24, eval_samples=4,
                max_new_tokens=10, chunk=12, total_samples=96, pool=24, token_budget=4096, warmup_samples=8,
                lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9)
    return EagleTrainConfig(**{**base, **kw})


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    logs: list[str] = []
    cfg = config(tmp_path, target_dir, "a")
    ckpt = train(cfg, log=logs.append, stop_at=48)  # an interrupted run
    assert json.loads((ckpt / "state.json").read_text())["samples"] == 48
    train(cfg, log=logs.append)  # resumes
    assert any("resumed from" in m for m in logs) and any("already in" in m for m in logs)
    straight = train(config(tmp_path, target_dir, "b"), log=lambda m: None)
    a, b = load_file(ckpt / "head.safetensors"), load_file(straight / "head.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same batches, same noise, same steps

    # the loss went down on the answers it trained on
    target = load_target(target_dir)
    processor = load_processor(TOKENIZER_DIR)
    answers = load_answers(tmp_path / "a" / "data", "train", 24)
    assert all(len(x.response) >= 1 for x in answers)
    torch.manual_seed(cfg.seed)
    head = EagleHead(EagleConfig.from_target(target))  # the init train() starts from
    head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    before = evaluate(head, target, processor, answers, cfg)
    head.load_state_dict(a)
    after = evaluate(head, target, processor, answers, cfg)
    assert after["eval_feat"] < 0.9 * before["eval_feat"] and after["eval_hard"] < before["eval_hard"]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 96 and state["history"][-1]["eval_tau_g4"] >= 1.0

    # export (fp16) and load back: with the target (shared lm_head) and without (read from its checkpoint)
    out = export_eagle(ckpt, tmp_path / "zoo" / "eagle")
    assert sorted(p.name for p in out.iterdir()) == ["eagle.safetensors", "eagle_config.json", "specula.json"]
    assert not (tmp_path / "zoo" / "manifest.json").exists()  # only the real zoo's manifest is rewritten
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "eagle" and info["trained_samples"] == 96 and info["target"] == str(target_dir)
    exported = load_file(out / "eagle.safetensors")
    assert all(v.dtype == torch.float16 for v in exported.values())
    assert (out / "eagle.safetensors").stat().st_size < 2 * 1.1 * info["params"]
    loaded = load_eagle(out, target)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, a[k], atol=2e-3, rtol=2e-3)
    assert loaded._shared[1] is target.model.get_output_embeddings()
    alone = load_eagle(out)  # no target in the process: frozen copies read from the target's checkpoint
    x = torch.randn(3, loaded.config.hidden_size)
    torch.testing.assert_close(alone.logits(x), loaded.logits(x))

    # and drafts through the engine from the exported directory, output unchanged
    reqs = [GenerationRequest(f"r{i}", a_.prompt, None, SamplingParams(max_tokens=8))
            for i, a_ in enumerate(answers) if not (a_.prompt == target.info.image_token_id).any()][:2]
    eos = [processor.tokenizer.eos_token_id]
    ref = SpecEngine(load_target(target_dir), None, eos_token_ids=eos).generate(reqs)
    got = SpecEngine(target, create({"kind": "eagle", "path": str(out), "structure": "tree"}, target=target),
                     gamma=3, eos_token_ids=eos).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in ref.items()}


def test_cached_answers_belong_to_their_settings(tmp_path, target_dir):
    train(config(tmp_path, target_dir, "c", total_samples=24), log=lambda m: None)
    with pytest.raises(ValueError, match="holds answers made with"):
        train(config(tmp_path, target_dir, "c", total_samples=24, max_new_tokens=12), log=lambda m: None)


def test_cli_trains_and_exports(tmp_path, target_dir):
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=8, samples=16,
                              max_new_tokens=6, seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9,
                              export=True, out=str(tmp_path / "out" / "eagle"))
    zoo = sorted(p.name for p in ZOO_DIR.iterdir()) if ZOO_DIR.is_dir() else []
    assert train_eagle_cli(args) == 0
    assert (tmp_path / "out" / "eagle" / "eagle.safetensors").exists()
    assert (sorted(p.name for p in ZOO_DIR.iterdir()) if ZOO_DIR.is_dir() else []) == zoo  # the zoo is untouched


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("data_samples", 0), ("soft", 1.5), ("noise", -1.0),
                                         ("pool", True), ("eval_engine", 500), ("grad_clip", 0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EagleTrainConfig(**{field: value})
