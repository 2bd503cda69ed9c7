"""Warm starts (training/drafters/warm_start.py): ``specula train eagle --init-from`` begins from an exported head of the same
config, trains against the target it is given, records what stands behind it; a head of another kind or config is
refused; ``specula zoo build --warm-from`` hands the option to the kinds that take it, with a share of the samples;
promote counts the samples behind a warm start but wants a quarter of the recipe's on the new target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_kit import save_lively_target

from specula.cli import build_parser
from specula.training.drafters.eagle import EagleTrainConfig, export_eagle, train
from specula.training.drafters.flash import FlashTrainConfig, train as train_flash
from specula.training import recipe
from specula.training.promote import MIN_WARM_SHARE, drafter_problem


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_lively_target(tmp_path_factory, "warm")


@pytest.fixture(scope="module")
def exported(target_dir, tmp_path_factory) -> Path:
    """An eagle head trained 48 samples on the target and exported (fp16)."""
    root = tmp_path_factory.mktemp("warm-src")
    ckpt = train(_config(root / "src", target_dir, total_samples=48), log=lambda m: None)
    return export_eagle(ckpt, root / "zoo" / "eagle")


def _config(run: Path, target_dir: Path, **kw) -> EagleTrainConfig:
    base = dict(run_dir=str(run), target=str(target_dir), data_samples=24, eval_samples=4, max_new_tokens=10,
                chunk=12, total_samples=24, pool=24, token_budget=4096, warmup_samples=8, lr=3e-3, eval_engine=0,
                ckpt_every_s=1e9, eval_every_s=1e9)
    return EagleTrainConfig(**{**base, **kw})


def test_a_warm_run_starts_from_the_export_then_trains_and_says_what_stands_behind_it(tmp_path, target_dir,
                                                                                       exported):
    logs: list[str] = []
    cfg = _config(tmp_path / "warm", target_dir, init_from=str(exported), seed=7)
    ckpt = train(cfg, log=logs.append, stop_at=0)  # a checkpoint before the first step: the starting weights
    start, src = load_file(ckpt / "head.safetensors"), load_file(exported / "eagle.safetensors")
    assert start.keys() == src.keys() and all(torch.equal(start[k], src[k].float()) for k in src)
    assert any("warm start from" in m and "48 samples behind it" in m for m in logs)
    ckpt = train(cfg, log=logs.append)  # resumes the warm run (no second warm start) and trains on
    assert sum("warm start from" in m for m in logs) == 1 and any("resumed from" in m for m in logs)
    trained = load_file(ckpt / "head.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    out = export_eagle(ckpt, tmp_path / "zoo" / "eagle")
    info = json.loads((out / "specula.json").read_text())
    assert (info["trained_samples"], info["init_samples"], info["init_from"]) == (24, 48, str(exported))
    fingerprint = info["target_sha256"]
    assert drafter_problem(out, fingerprint, 72) is None  # 24 own + 48 behind it
    assert "the recipe's are 80" in drafter_problem(out, fingerprint, 80)
    fresh = export_eagle(train(_config(tmp_path / "fresh", target_dir), log=lambda m: None), tmp_path / "f" / "eagle")
    assert json.loads((fresh / "specula.json").read_text())["init_samples"] == 0


def test_promote_counts_the_samples_behind_a_warm_start_but_wants_a_share_on_the_new_target(tmp_path):
    def problem(own: int, behind: int, recipe_samples: int) -> str | None:
        (tmp_path / "specula.json").write_text(json.dumps({"target_sha256": "t", "trained_samples": own,
                                                           "init_samples": behind}))
        return drafter_problem(tmp_path, "t", recipe_samples)

    assert problem(1000, 0, 1000) is None and problem(250, 750, 1000) is None
    assert "trained on 900 samples, the recipe's are 1000" in problem(300, 600, 1000)
    assert "warm-started, then trained on 249 samples" in problem(249, 5000, 1000)
    assert MIN_WARM_SHARE == 0.25


def test_a_head_of_another_kind_or_config_is_refused(tmp_path, target_dir, exported):
    flash = FlashTrainConfig(**{**_config(tmp_path / "flash", target_dir).__dict__, "init_from": str(exported)})
    with pytest.raises(ValueError, match="holds no flash head"):
        train_flash(flash, log=lambda m: None)
    other = tmp_path / "other"
    other.mkdir()
    for f in ("eagle.safetensors", "specula.json"):
        (other / f).write_bytes((exported / f).read_bytes())
    cfg = json.loads((exported / "eagle_config.json").read_text())
    cfg["intermediate_size"] += 8
    (other / "eagle_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="another config"):
        train(_config(tmp_path / "w2", target_dir, init_from=str(other)), log=lambda m: None)


def test_the_flag_reaches_the_config():
    args = build_parser().parse_args(["train", "eagle", "--init-from", "eagle"])
    assert args.init_from == "eagle"
    assert build_parser().parse_args(["train", "aasd"]).init_from is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "massv", "--init-from", "massv"])  # its trainer has none


def test_build_warm_starts_the_kinds_that_can_with_a_share_of_the_samples(tmp_path):
    warm = tmp_path / "shipped"
    for name in ("eagle", "msd", "text_lm"):
        (warm / name).mkdir(parents=True)
        (warm / name / "specula.json").write_text("{}")
    steps = {d.name: d for d in recipe.DRAFTERS}
    target, zoo, runs = tmp_path / "zoo" / "target", tmp_path / "zoo", tmp_path / "runs"

    def argv(name, **kw):
        return recipe.drafter_argv(steps[name], target, zoo, runs, **kw)

    def flag(a, f):
        return a[a.index(f) + 1] if f in a else None

    for name in ("eagle", "msd"):
        a = argv(name, warm_from=warm, warm_share=1 / 3)
        assert flag(a, "--init-from") == str(warm / name)
        assert int(flag(a, "--samples")) == round(recipe.scaled(int(flag(argv(name), "--samples")), 1.0) / 3)
        assert flag(a, "--data-samples") == flag(argv(name), "--data-samples")  # answers: as many as ever
    assert argv("text_lm", warm_from=warm) == argv("text_lm")  # its trainer cannot warm-start
    assert argv("flash", warm_from=warm) == argv("flash")  # nothing exported to start from
    assert "--init-from" not in argv("eagle")
    args = build_parser().parse_args(["zoo", "build", "--drafters-only", "--warm-from", str(warm)])
    assert args.warm_from == str(warm) and args.warm_share == pytest.approx(1 / 3)
