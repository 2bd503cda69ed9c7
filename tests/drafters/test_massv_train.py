"""``specula train massv`` on a tiny random LLaVA target saved to a temporary directory: phase 1 trains only the
projector, phase 2 (SDViT) trains on the target's own sampled answers, the held-out loss falls, an interrupted run
resumes to exactly the weights of an uninterrupted one, the export loads as a ``massv`` drafter (and its LM as a
``text_lm``) that keeps greedy output equal to plain decoding; the w/o-SDViT ablation trains on reference answers.
Nothing is written into the zoo."""

from __future__ import annotations

import json

import pytest
import torch
from drafter_kit import world_requests
from safetensors.torch import load_file
from trainer_kit import save_lively_target

from specula import cli
from specula.drafters import create
from specula.training.drafters import massv as tm
from specula.training.drafters.distill_data import load_answers, pixels
from specula.training.drafters.massv import MassvTrainConfig, export_massv, train
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.world import generate
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "massv")


def small(tmp_path, target_dir, name="run", **kw) -> MassvTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), init_lm=None, arch="tiny", pretrain_total=16,
                data_samples=8, sdvit_total=24, eval_samples=4, max_new_tokens=8, caption_max_tokens=8, chunk=4,
                gen_batch=4, pool=8, token_budget=4096, warmup_samples=2, pretrain_lr=1e-2, sdvit_lr=5e-3,
                ckpt_every_s=1e9, eval_every_s=1e-9)
    return MassvTrainConfig(**{**base, **kw})


def lm_weights(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if k.startswith("lm.")}


def test_two_phases_learn_resume_exactly_and_export(tmp_path, target_dir):
    logs: list[str] = []
    cfg = small(tmp_path, target_dir)
    ckpt = train(cfg, log=logs.append, stop_at=16)  # phase 1 only: the LM is frozen
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 16 and state["phase"] == 1
    target = load_target(target_dir)
    fresh = tm.build(cfg, target, load_processor(TOKENIZER_DIR).tokenizer).state_dict()
    after1 = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(after1[k], fresh[k]) for k in lm_weights(after1))  # LM untouched in phase 1
    assert not torch.equal(after1["projector.0.weight"], fresh["projector.0.weight"])  # the projector learned
    # SDViT data: the target's own answers at temperatures 0 / 0.7 / 1 (greedy ones equal plain decoding)
    answers = load_answers(tmp_path / "run" / "data", "vision", 8)
    assert [a.index for a in answers] == list(range(cfg.data_start, cfg.data_start + 8))
    greedy = [a for a in answers if cfg.temperatures[a.index % 3] == 0]
    ref = target.generate_plain([__import__("specula.targets", fromlist=["x"]).PrefillRequest(
        "g", greedy[0].prompt, pixels(load_processor(TOKENIZER_DIR), greedy[0], cfg.seed))], 8,
        [load_processor(TOKENIZER_DIR).tokenizer.eos_token_id])[0]
    assert greedy[0].response.tolist() == ref

    ckpt = train(cfg, log=logs.append)  # resumes into phase 2
    assert any("resumed" in m and "phase 1" in m for m in logs)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] == 40 and state["phase"] == 2
    hist = state["history"]
    assert hist[-1]["eval_ce"] < hist[0]["eval_ce"]  # it learns the target's answers
    assert {"eval_tau_g4", "eval_tau_g4_text", "eval_agree"} <= set(hist[-1])
    done = load_file(ckpt / "model.safetensors")
    assert not all(torch.equal(done[k], after1[k]) for k in lm_weights(done))  # the LM trains in phase 2

    straight = train(small(tmp_path, target_dir, "straight"), log=lambda m: None)  # the same run, uninterrupted
    other = load_file(straight / "model.safetensors")
    assert all(torch.equal(other[k], done[k]) for k in done)  # an interrupted run resumes exactly

    out = export_massv(ckpt, tmp_path / "export" / "massv")
    info = json.loads((out / "specula.json").read_text())
    assert info["kind"] == "massv" and info["sdvit"] and info["trained_samples"] == 40
    processor = load_processor(TOKENIZER_DIR)
    reqs = world_requests(processor, 3, SamplingParams(max_tokens=10), suites=["vqa", "text", "multi_image"])
    plain = SpecEngine(load_target(target_dir), None, eos_token_ids=[-1]).generate(reqs)
    for kind in ("massv", "ensemble", "text_lm"):
        t = load_target(target_dir)
        d = create({"kind": kind, "path": str(out)}, target=t)
        assert next(d.model.parameters()).dtype == torch.float32
        got = SpecEngine(t, d, gamma=3, eos_token_ids=[-1]).generate(reqs)
        assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in plain.items()}, kind


def test_without_sdvit_trains_on_reference_answers(tmp_path, target_dir, monkeypatch):
    made = []
    real = tm.sampled_answers
    monkeypatch.setattr(tm, "sampled_answers", lambda *a, **k: made.append(1) or real(*a, **k))
    cfg = small(tmp_path, target_dir, sdvit=False, pretrain_total=8, sdvit_total=8, eval_every_s=1e9)
    ckpt = train(cfg, log=lambda m: None)
    assert not made and not list((tmp_path / "run" / "data").glob("vision-*"))  # the target answers nothing
    assert json.loads((ckpt / "state.json").read_text())["samples"] == 16
    state = json.loads((ckpt / "state.json").read_text())  # a checkpoint from before text_every resumes as text_every 0
    del state["config"]["text_every"]
    (ckpt / "state.json").write_text(json.dumps(state))
    assert json.loads((train(cfg, log=lambda m: None) / "state.json").read_text())["samples"] == 16
    with pytest.raises(ValueError, match="another run_dir"):  # a checkpoint refuses another recipe
        train(small(tmp_path, target_dir, sdvit=True, pretrain_total=8, sdvit_total=8), log=lambda m: None)


def test_text_every_mixes_the_targets_answers_to_text_conversations(tmp_path, target_dir, monkeypatch):
    """``text_every``: data_samples // n text-only conversations answered by the target (greedy ones equal plain
    decoding) and every n-th phase-2 sample is one of them (no image); the others keep their images."""
    seen = []
    real = tm.losses
    monkeypatch.setattr(tm, "losses", lambda model, target, items, *a: seen.extend(items) or real(model, target, items,
                                                                                                 *a))
    cfg = small(tmp_path, target_dir, text_every=2, pretrain_total=4, sdvit_total=8, eval_every_s=1e9)
    assert cfg.text_samples == 4
    train(cfg, log=lambda m: None)
    texts = load_answers(tmp_path / "run" / "data", "text", 4)
    processor = load_processor(TOKENIZER_DIR)
    image = load_target(target_dir).info.image_token_id
    assert all(a.split == "text" and not (a.prompt == image).any() for a in texts)
    greedy = next(a for a in texts if cfg.temperatures[a.index % 3] == 0)
    from specula.targets import PrefillRequest
    ref = load_target(target_dir).generate_plain([PrefillRequest("g", greedy.prompt, None)], 8,
                                                  [processor.tokenizer.eos_token_id])[0]
    assert greedy.response.tolist() == ref
    assert len(seen) == 12  # 4 caption samples, then 8 of phase 2 (batched by length, not in order)
    prompts = {tuple(a.prompt.tolist()) for a in texts}
    no_image = [it for it in seen if it.pixel_values is None]
    assert len(no_image) == 4 and all(tuple(it.prompt.tolist()) in prompts for it in no_image)
    with pytest.raises(ValueError, match="text_every"):
        small(tmp_path, target_dir, text_every=-1)


def test_reference_answers_follow_the_chat_template():
    processor = load_processor(TOKENIZER_DIR)
    s = generate("caption", "train", 3)
    ids, pix, resp = tm.reference_answer(processor, s)
    tok = processor.tokenizer
    assert resp[-1] == tok.eos_token_id and pix.shape[0] == 1
    assert tok.decode(resp[:-1]).strip() == s.response.strip()
    kinds = {tm.caption_sample(i, 0).kind for i in range(40)}  # phase 1 draws caption tasks only
    assert all("caption" in k for k in kinds) and len(kinds) >= 2


def test_bad_config_is_refused(tmp_path, target_dir):
    for bad, match in [({"feature": "pixels"}, "feature"), ({"data_samples": 0}, "data_samples"),
                       ({"temperatures": ()}, "temperatures"), ({"top_p": 0}, "top_p"), ({"sdvit_lr": 0}, "sdvit_lr"),
                       ({"pool_grids": (0,)}, "pool_grids"), ({"sdvit": "yes"}, "sdvit"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=match):
            small(tmp_path, target_dir, **bad)


def test_cli_wires_the_recipe_and_the_ablation(monkeypatch):
    seen = []
    monkeypatch.setattr(tm, "train", lambda cfg: seen.append(cfg) or "ckpt")
    parser = cli.build_parser()
    args = parser.parse_args(["train", "massv", "--init-lm", "none", "--arch", "tiny", "--pretrain-samples", "5",
                              "--samples", "7", "--data-samples", "3", "--no-sdvit"])
    assert args.func(args) == 0
    cfg = seen[0]
    assert (cfg.run_dir, cfg.init_lm, cfg.arch, cfg.pretrain_total, cfg.sdvit_total, cfg.data_samples, cfg.sdvit) \
        == ("runs/massv-no-sdvit", None, "tiny", 5, 7, 3, False)
    args = parser.parse_args(["train", "massv"])
    args.func(args)
    assert (seen[1].run_dir, seen[1].init_lm, seen[1].sdvit, seen[1].feature) == \
        ("runs/massv", "text_lm", True, "pre_projector")
