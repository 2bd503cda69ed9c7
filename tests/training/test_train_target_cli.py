"""``specula train target``'s flags come from TrainConfig's fields (training/target/cli.py): one flag per field, with
the field's default and help, and the parsed flags give back the config they name."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from specula.training import recipe
from specula.training.target import cli
from specula.training.target.config import SET_HOP_NAMES, TrainConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specula train target")
    cli.add_train_target_arguments(p)
    return p


def _argv(cfg: dict) -> list[str]:
    """The command line of a config's non-default fields."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        value = cfg.get(f.name, f.default)
        if value == f.default:
            continue
        flag = cli.flag_name(f)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def test_every_field_has_a_flag_with_its_default_and_help():
    actions = {a.dest: a for a in _parser()._actions}
    for f in dataclasses.fields(TrainConfig):
        a = actions[f.name]
        assert a.default == f.default and type(a.default) is type(f.default), f.name
        assert f.metadata["help"].strip() and a.help.strip(), f.name
        assert cli.flag_name(f) in a.option_strings
    assert set(actions) - {f.name for f in dataclasses.fields(TrainConfig)} == {"help", "export"}
    assert cli.config_from_args(_parser().parse_args([])) == TrainConfig()  # the defaults are TrainConfig's
    assert "--samples" in _parser().format_help()  # the help renders (a % in a help text would break it)


def test_flags_parse_into_the_config():
    cfg = cli.parse_config(["--run-dir", "r", "--samples", "90000", "--ckpt-every", "60", "--eval-every", "1e9",
                            "--lr", "6e-4", "--mix", "scan_suites", "--freeze-vision", "--vision-lr", "5e-4",
                            "--set-hops", "reader", "--chart-words", "--init-from", "zoo/weights/target"])
    assert (cfg.run_dir, cfg.total_samples, cfg.ckpt_every_s, cfg.eval_every_s) == ("r", 90_000, 60.0, 1e9)
    assert (cfg.lr, cfg.mix, cfg.freeze_vision, cfg.vision_lr) == (6e-4, "scan_suites", True, 5e-4)
    assert (cfg.set_hops, cfg.chart_words, cfg.init_from) == ("reader", "parts", "zoo/weights/target")
    assert type(cfg.total_samples) is int and type(cfg.vision_lr) is float
    assert cli.parse_config(["--chart-words", "whole"]).chart_words == "whole"
    assert not cli.parse_config(["--freeze-vision", "--no-freeze-vision"]).freeze_vision
    with pytest.raises(SystemExit):
        cli.parse_config(["--set-hops", "sideways"])
    with pytest.raises(ValueError, match="unknown mix"):
        cli.parse_config(["--mix", "nonsense"])


def test_the_flags_name_every_stage_of_the_recipe():
    """Each training stage's TrainConfig comes back from its own command line: ``specula train target`` can run any
    of them by hand."""
    for st in recipe.TARGET_STAGES:
        if st.kind == "train":
            cfg = recipe.stage_config(st, Path("runs"))
            assert cli.parse_config(_argv(cfg)) == TrainConfig(**cfg), st.name


def test_set_hop_names_are_the_set_hops():
    from specula.training.target.set_referents import SET_HOPS

    assert SET_HOP_NAMES == tuple(SET_HOPS)


def test_the_handler_trains_the_config_and_exports_when_asked(monkeypatch, tmp_path):
    import specula.targets.processor as processor
    import specula.training.build as build
    import specula.training.target.train as train

    got = []
    monkeypatch.setattr(processor, "load_processor", lambda path: "processor")
    monkeypatch.setattr(train, "train", lambda cfg, proc: got.append((cfg, proc)) or tmp_path / "ckpt")
    monkeypatch.setattr(build, "export", lambda ckpt: got.append(ckpt) or tmp_path / "zoo")
    args = _parser().parse_args(["--samples", "8"])
    assert args.func is cli.train_target_cli and args.func(args) == 0
    assert got == [(TrainConfig(total_samples=8), "processor")]
    args = _parser().parse_args(["--export"])
    assert args.func(args) == 0 and got[-1] == tmp_path / "ckpt"
