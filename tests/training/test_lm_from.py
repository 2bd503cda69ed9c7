"""``--lm-from`` with ``--vision-from``: a fresh run pairs one run's code LM with another run's tower and fitted
projector, as a command (it was a hand-made merge)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specula.training.target.train import TrainConfig, train

VISION = ("model.vision_tower.", "model.multi_modal_projector.")
BASE = dict(arch="tiny", total_samples=0, pool=4, token_budget=2048, warmup_samples=4, eval_n=1, eval_every_s=1e9,
            ckpt_every_s=1e9, threads=1, code_lm_samples=8, code_lm_layers=1, code_token_budget=2048)


@pytest.mark.slow
def test_a_fresh_run_pairs_one_runs_lm_with_another_runs_tower(tmp_path, processor):
    quiet = lambda m: None  # noqa: E731
    lm_run = train(TrainConfig(run_dir=str(tmp_path / "lm"), vision_images=8, **BASE), processor, log=quiet)
    vision_run = train(TrainConfig(run_dir=str(tmp_path / "vis"), vision_images=16, projector_fit_images=4,
                                   code_lm_mix="scenes", **BASE), processor, log=quiet)
    logs = []
    merged = train(TrainConfig(run_dir=str(tmp_path / "m"), vision_images=16, projector_fit_images=4,
                               lm_from=str(lm_run), vision_from=str(vision_run), **BASE), processor, log=logs.append)
    a, v, m = (load_file(p / "model.safetensors") for p in (lm_run, vision_run, merged))
    vision = [k for k in m if k.startswith(VISION)]
    lm = [k for k in m if not k.startswith(VISION)]
    assert vision and lm
    assert all(torch.equal(m[k], v[k]) for k in vision)
    assert all(torch.equal(m[k], a[k]) for k in lm)
    assert any(not torch.equal(a[k], v[k]) for k in lm) and any(not torch.equal(a[k], v[k]) for k in vision)
    state = json.loads((merged / "state.json").read_text())
    src = json.loads((vision_run / "state.json").read_text())
    assert state["lm_from"] == str(lm_run) and state["code_lm_done"] and state["code_lm_samples"] == 8
    assert state["elapsed_s"] >= json.loads((lm_run / "state.json").read_text())["elapsed_s"] > 0
    assert state["projector_fit"] == src["projector_fit"]  # the loaded projector is the fit: not fitted again
    assert not any(msg.startswith(("vision stage", "projector fit")) for msg in logs), logs

    joint = tmp_path / "joint"  # a run whose joint stage has begun cannot give its LM
    shutil.copytree(lm_run, joint)
    info = json.loads((joint / "state.json").read_text())
    (joint / "state.json").write_text(json.dumps({**info, "samples": 8}))
    with pytest.raises(ValueError, match="joint stage has begun"):
        train(TrainConfig(run_dir=str(tmp_path / "x"), vision_images=16, lm_from=str(joint), **BASE), processor,
              log=quiet)
    with pytest.raises(ValueError, match="word-code recipe"):
        TrainConfig(lm_from=str(lm_run))


def test_cli_flag():
    from specula.training.target.cli import parse_config

    cfg = parse_config(["--code-lm-samples", "8", "--lm-from", "a/ckpt", "--vision-from", "b/ckpt"])
    assert (cfg.lm_from, cfg.vision_from) == ("a/ckpt", "b/ckpt")
    assert parse_config([]).lm_from is None
