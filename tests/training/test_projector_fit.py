"""Closed-form projector alignment (training/target/projector_fit.py): the stock MLP projector ends up computing the ridge map."""

import json

import pytest
import torch

from specula.world import generate
from specula.training.target.batching import Encoder
from specula.training.target.projector_fit import fit_projector
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, train
from specula.training.target.vision_heads import tower_features
from specula.training.target.word_codes import WordCodes


def _tiny(processor):
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    return model, Encoder(processor, codes=WordCodes(model.config.text_config.hidden_size, 0))


def test_fit_lowers_the_code_loss_and_the_mlp_computes_the_linear_map(processor):
    model, enc = _tiny(processor)
    fit = fit_projector(model, enc, 48, seed=0, log=lambda m: None)
    assert fit.images == 48 and fit.patches == 48 * 144
    assert fit.loss_after < 0.8 * fit.loss_before and fit.max_gelu_error < 1e-3
    proj = model.model.multi_modal_projector
    x = torch.randn(5, proj.linear_1.in_features) * 0.1
    w, b = proj.linear_1.weight, proj.linear_1.bias - fit.shift  # the linear map the fit wrote
    with torch.no_grad():
        torch.testing.assert_close(proj(x), x @ w.T + b, atol=2e-3, rtol=0)
    # held-out images: the fitted projector is closer to the codes than the untrained one
    fresh, _ = _tiny(processor)
    s = enc.encode(generate("vqa", "eval", 7, 0))
    with torch.no_grad():
        err = [float((tower_features(m, s.pixel_values)[1] - s.patch_codes).pow(2).sum(-1).mean()) for m in (model, fresh)]
    assert err[0] < err[1]


def test_fit_needs_codes_and_a_square_projector(processor):
    model, _ = _tiny(processor)
    with pytest.raises(ValueError, match="word codes"):
        fit_projector(model, Encoder(processor), 8, seed=0)
    with pytest.raises(ValueError, match="word-code recipe"):
        TrainConfig(projector_fit_images=8)
    with pytest.raises(ValueError, match="projector_fit_gate"):
        TrainConfig(code_lm_samples=8, projector_fit_gate=True)  # no fit to gate


def test_train_fits_once_after_the_vision_stage(tmp_path, processor):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=4, pool=2, token_budget=2048,
                      warmup_samples=2, eval_n=1, eval_every_s=1e9, threads=1, vision_images=32, code_lm_samples=8,
                      code_token_budget=1024, projector_fit_images=32)
    logs = []
    train(cfg, processor, log=logs.append)
    state = json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())
    assert state["projector_fit"]["images"] == 32 and state["projector_fit"]["at_samples"] == 0
    assert sum(m.startswith("projector fit:") for m in logs) == 1
    logs.clear()
    train(TrainConfig(**{**cfg.__dict__, "total_samples": 8}), processor, log=logs.append)  # resumed: not again
    assert not any(m.startswith("projector fit:") for m in logs)


def test_gated_projector_passes_objects_and_zeroes_the_background(processor):
    """write_gated: where the gate score is positive the stock MLP computes W x + b; where it is far negative the
    output is exactly zero."""
    from specula.training.target.projector_fit import write_gated

    model, _ = _tiny(processor)
    proj = model.model.multi_modal_projector
    d_in, h = proj.linear_1.in_features, proj.linear_2.out_features
    g = torch.Generator().manual_seed(0)
    # the tiny model's projector is square (64 -> 64); the gate needs the map's span to leave room: rank 16 here
    w = (torch.randn(h, 16, generator=g) @ torch.randn(16, d_in, generator=g)) * 0.02
    b = torch.randn(h, generator=g) * 0.05
    ws = torch.zeros(d_in)
    ws[0] = 1.0  # the gate reads feature 0: objects have it >= 0.5, background <= -0.5
    x = torch.randn(64, d_in, generator=g) * 0.3
    x[:32, 0], x[32:, 0] = 0.5 + torch.rand(32, generator=g), -0.5 - torch.rand(32, generator=g)
    lin = x @ w.T + b
    write_gated(proj, w, b, 4.5, ws, 0.0, k=(10 + 4.5 + float(lin.abs().max())) / 0.5)
    with torch.no_grad():
        out = proj(x)
    torch.testing.assert_close(out[:32], lin[:32], atol=1e-3, rtol=0)
    assert float(out[32:].abs().max()) < 1e-6
    with pytest.raises(ValueError, match="no room"):  # a full-rank map spans everything
        write_gated(proj, torch.randn(h, d_in, generator=g), b, 4.5, ws, 0.0, k=10.0)


def test_gate_flag_reaches_the_fit(processor):
    from specula.training.target.cli import parse_config

    cfg = parse_config(["--code-lm-samples", "8", "--projector-fit-images", "96", "--projector-fit-gate"])
    assert cfg.projector_fit_gate and cfg.projector_fit_images == 96
