"""``specula train msd`` on a tiny random LLaVA target saved to a temporary directory: the progressive mix follows
eq. 10, the recipe makes D_text / D_vis from the target's own answers, lowers the loss, resumes exactly, refuses to
resume another recipe, exports fp16 weights that load back and draft through the engine; the ablations run from
the CLI. Nothing is written into the zoo."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from trainer_kit import (answer_requests, assert_drafts_like_plain, assert_export_loads, assert_loss_falls,
                         assert_resumes_exactly, save_lively_target, zoo_listing)

from specula.drafters import create
from specula.training.drafters import msd as tm
from specula.training.drafters.distill_data import load_answers
from specula.drafters.msd_head import MsdConfig, MsdHead, load_msd
from specula.training.drafters.eagle import collate, target_features
from specula.training.drafters.msd import MsdTrainConfig, Schedule, export_msd, train, train_msd_cli, vision_share
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR, ZOO_DIR


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "msd")


def config(tmp_path, target_dir, name: str, **kw) -> MsdTrainConfig:
    base = dict(run_dir=str(tmp_path / name), target=str(target_dir), data_samples=12, text_samples=12,
                eval_samples=4, max_new_tokens=8, chunk=6, total_samples=60, pool=6, token_budget=2048,
                warmup_samples=6, lr=3e-3, eval_engine=2, ckpt_every_s=1e9, eval_every_s=1e9)
    return MsdTrainConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------------------- schedule


def test_the_progressive_mix_grows_from_text_to_multimodal():
    s = Schedule(total=3000, stage1=1000)
    T = 2000
    assert [vision_share(t, T) for t in (0, T // 2, T)] == [0.0, 0.5, 1.0]
    assert [s.share(j) for j in (0, 999, 1000, 2000, 3000)] == [0.0, 0.0, 0.0, 0.5, 1.0]
    src = [s.source(j) for j in range(3000)]
    assert all(k == "text" for k, _ in src[:1000]) and [i for _, i in src[:1000]] == list(range(1000))
    assert [s.stage(j) for j in (0, 999, 1000, 2999)] == [1, 1, 2, 2]

    def share(lo, hi):  # share of multimodal samples among stage-2 samples lo .. hi - 1
        return sum(src[1000 + k][0] == "vision" for k in range(lo, hi)) / (hi - lo)

    assert share(0, 100) == pytest.approx(0.025, abs=0.01)  # t = 0: (almost) all text
    assert share(T // 2 - 100, T // 2 + 100) == pytest.approx(0.5, abs=0.01)  # t = T/2: half and half
    assert share(T - 100, T) == pytest.approx(0.975, abs=0.01)  # t = T: (almost) all multimodal
    assert share(0, T) == pytest.approx(0.5, abs=1e-3)
    # each set is read in order, without skipping or repeating: stage 2 continues D_text where stage 1 left it
    assert [i for k, i in src if k == "vision"] == list(range((T - 1) // 2))
    assert [i for k, i in src if k == "text"] == list(range(3000 - (T - 1) // 2))
    # without stage 1 the mix starts at sample 0
    assert Schedule(3000, 0).source(0) == ("text", 0) and Schedule(3000, 0).share(1500) == 0.5
    assert MsdTrainConfig(total_samples=90, stage1=False).stage1_samples == 0
    assert MsdTrainConfig(total_samples=90).stage1_samples == 30


# ------------------------------------------------------------------------------------------------------- training


def test_train_lowers_the_loss_resumes_exactly_exports_and_reloads(tmp_path, target_dir):
    cfg = config(tmp_path, target_dir, "a")
    assert cfg.stage1_samples == 20
    ckpt, a = assert_resumes_exactly(train, cfg, config(tmp_path, target_dir, "b"), 36)  # interrupted in stage 2

    # D_text holds text-only conversations, D_vis prompts with images; both are the target's own answers
    target = load_target(target_dir)
    image = target.info.image_token_id
    text = load_answers(tmp_path / "a" / "data", "text", 12)
    vision = load_answers(tmp_path / "a" / "data", "vision", 12)
    assert not any((x.prompt == image).any() for x in text) and all((x.prompt == image).any() for x in vision)
    assert all(len(x.response) >= 1 for x in text + vision)

    # the head reads, at image positions, the embeddings the target read there (what the engine passes it)
    processor = load_processor(TOKENIZER_DIR)
    batch = collate(vision[:3], processor, cfg.seed, processor.tokenizer.pad_token_id)
    _, embeds = target_features(target.model, batch, "cpu", embeds=True)  # [B, L, H]
    H = target.info.hidden_size
    vis = target.encode_images(batch.pixel_values, "projected").features.reshape(-1, H)  # every image, in order
    torch.testing.assert_close(embeds[batch.input_ids == image], vis.float())

    # the loss went down on what it trained on, text and multimodal
    torch.manual_seed(cfg.seed)
    head = MsdHead(MsdConfig.from_target(target))  # the init train() starts from
    head.attach(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    assert_loss_falls(head, a, target, processor, text + vision, cfg)
    state = json.loads((ckpt / "state.json").read_text())
    last = state["history"][-1]
    assert state["samples"] == 60 and last["eval_tau_g4"] >= 1.0 and last["stage"] == 2 and last["vision_share"] > 0.9

    # export (fp16) and load back, with the target and without
    out = export_msd(ckpt, tmp_path / "zoo" / "msd")
    info, loaded = assert_export_loads(out, "msd", load_msd, target, a)
    assert info["decoupled"] and info["trained_samples"] == 60
    assert info["stage1_samples"] == 20 and info["stage2_samples"] == 40
    assert loaded.config.decoupled

    # drafts through the engine from the exported directory on image prompts, output unchanged
    reqs = answer_requests(processor, vision[:3], cfg.seed)
    d = create({"kind": "msd", "path": str(out), "structure": "tree"}, target=target)
    assert d.spec.needs == frozenset({"hidden", "visual"})
    assert_drafts_like_plain(target_dir, target, d, reqs, 3, [processor.tokenizer.eos_token_id])

    # a checkpoint refuses to be resumed by another recipe
    with pytest.raises(ValueError, match="trained with"):
        train(config(tmp_path, target_dir, "a", decoupled=False), log=lambda m: None)


def _args(tmp_path, target_dir, **kw):
    base = dict(run_dir=str(tmp_path / "run"), target=str(target_dir), data_samples=6, samples=12, max_new_tokens=6,
                seed=0, threads=1, device="cpu", ckpt_every=1e9, eval_every=1e9, export=True,
                out=str(tmp_path / "out" / "msd"), text_samples=None, stage1_fraction=1 / 3, no_stage1=False,
                no_decouple=False, data_dir=None)
    return argparse.Namespace(**{**base, **kw})


def test_cli_runs_the_ablations(tmp_path, target_dir, capsys):
    zoo = zoo_listing()
    data = str(tmp_path / "shared-data")
    for name, flags in [("no-decouple", {"no_decouple": True}), ("no-stage1", {"no_stage1": True})]:
        args = _args(tmp_path, target_dir, run_dir=str(tmp_path / name), out=str(tmp_path / "out" / name),
                     data_dir=data, **flags)
        assert train_msd_cli(args) == 0
        info = json.loads((tmp_path / "out" / name / "specula.json").read_text())
        cfg = json.loads((tmp_path / "out" / name / "msd_config.json").read_text())
        assert cfg["decoupled"] == (name != "no-decouple") == info["decoupled"]
        assert info["stage1_samples"] == (0 if name == "no-stage1" else 4) and info["text_samples"] == 6
    assert "already in" in capsys.readouterr().out  # the second ablation reused the first one's answers
    assert not (tmp_path / "no-decouple" / "data").exists()
    d = create({"kind": "msd", "path": str(tmp_path / "out" / "no-decouple")}, target=load_target(target_dir))
    assert not d.decoupled and d.spec.needs == frozenset({"hidden"})
    assert zoo_listing() == zoo  # the zoo is untouched


def test_cli_names_the_ablation_runs(tmp_path, target_dir, monkeypatch):
    """With the default run dir, an ablation trains next to MSD on its answers and exports next to it."""
    seen = {}
    monkeypatch.setattr(tm, "train", lambda cfg: seen.setdefault("cfg", cfg) and tmp_path)
    monkeypatch.setattr(tm, "export_msd", lambda ckpt, out: seen.setdefault("out", out))
    train_msd_cli(_args(tmp_path, target_dir, run_dir="runs/msd", out=None, no_decouple=True, no_stage1=True))
    cfg = seen["cfg"]
    assert cfg.run_dir == "runs/msd-no-decouple-no-stage1" and cfg.data_dir == "runs/msd/data"
    assert not cfg.decoupled and not cfg.stage1 and cfg.text_samples == 6
    assert seen["out"] == ZOO_DIR / "msd-no-decouple-no-stage1"


@pytest.mark.parametrize("field,value", [("text_samples", 0), ("stage1_fraction", 1.0), ("stage1_fraction", -0.1),
                                         ("stage1", "no"), ("decoupled", 1), ("lr", 0.0), ("data_samples", 0)])
def test_bad_training_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        MsdTrainConfig(**{field: value})


def test_specula_train_msd_is_wired():
    from specula.cli import build_parser

    args = build_parser().parse_args(["train", "msd", "--no-decouple", "--stage1-fraction", "0.25", "--samples", "9"])
    assert args.no_decouple and not args.no_stage1 and args.stage1_fraction == 0.25 and args.samples == 9
    assert args.run_dir == "runs/msd" and args.text_samples is None and args.data_dir is None and args.func
