"""The tower's place signal and the fixed-vision stages: the place head's labels and loss, a vision stage that keeps a
fitted projector, the refit after an extended vision stage, and a joint stage that trains only the LM."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specula.world import generate
from specula.world.vocab import POSITIONS
from specula.training.target.batching import Encoder, patch_classes
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, load_heads, train
from specula.training.target.vision_heads import VisionHeads, vision_stage


def _vision_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))}


def test_patch_classes_give_each_patch_its_cell():
    cells = list(POSITIONS)
    names = list(POSITIONS.values())
    seen = 0
    for i in range(6):
        s = generate("vqa", "eval", i, 0)
        cls = patch_classes(s.patch_words)  # [1, 144, 3]
        assert cls.shape == (1, 144, 3)
        for j, words in enumerate(s.patch_words[0]):
            if words:  # an object patch: its object's cell, the one its "where" answer names
                assert names[int(cls[0, j, 2])] == " ".join(words[3:])
                seen += 1
            else:  # background: the cell the patch lies in (12 x 12 patches, 4 x 4 per cell)
                assert cells[int(cls[0, j, 2])] == (j // 12 // 4, j % 12 // 4)
    assert seen > 0


def test_place_head_adds_its_loss_and_old_heads_load(tmp_path):
    torch.manual_seed(0)
    feats = torch.randn(2, 144, 32)  # [N, T, D]
    s = generate("vqa", "eval", 1, 0)
    cls = torch.cat([patch_classes(s.patch_words)] * 2)  # [2, 144, 3]
    plain = VisionHeads(32)
    placed = VisionHeads(32, place_weight=2.0)
    placed.load_state_dict({**plain.state_dict(), **{k: v for k, v in placed.state_dict().items()
                                                      if k.startswith("place.")}})
    base, with_place = plain.loss(feats, cls), placed.loss(feats, cls)
    place_only = torch.nn.functional.cross_entropy(placed.place(placed.norm(feats)).flatten(0, 1), cls[..., 2].flatten())
    torch.testing.assert_close(with_place, base + 2.0 * place_only)
    # a checkpoint from before the place head: the head starts fresh; and the other way round it is dropped
    save_file(plain.state_dict(), tmp_path / "old.safetensors")
    save_file(placed.state_dict(), tmp_path / "new.safetensors")
    logs = []
    fresh = VisionHeads(32, place_weight=1.0)
    load_heads(fresh, tmp_path / "old.safetensors", logs.append)
    torch.testing.assert_close(fresh.colour.weight, plain.colour.weight)
    assert any("starts fresh" in m for m in logs)
    logs.clear()
    load_heads(VisionHeads(32), tmp_path / "new.safetensors", logs.append)
    assert any("not used" in m for m in logs)


def test_vision_stage_can_keep_a_fitted_projector(processor):
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    before = _vision_state(model)
    heads = VisionHeads(model.config.vision_config.hidden_size, place_weight=1.0)
    place_before = heads.place.weight.detach().clone()
    vision_stage(model, heads, Encoder(processor), 32, 0, lr=1e-3, log=lambda m: None, train_projector=False,
                 batch_images=16)
    after = _vision_state(model)
    proj = [n for n in before if "multi_modal_projector" in n]
    tower = [n for n in before if "vision_tower" in n]
    assert all(torch.equal(before[n], after[n]) for n in proj)
    assert any(not torch.equal(before[n], after[n]) for n in tower)
    assert not torch.equal(place_before, heads.place.weight)
    assert all(p.requires_grad for p in model.parameters())  # the stage restores what it froze


def test_extended_vision_stage_keeps_the_fit_then_refits(tmp_path, processor):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=0, pool=2, token_budget=2048,
                      warmup_samples=2, eval_n=1, eval_every_s=1e9, threads=1, vision_images=16, code_lm_samples=8,
                      code_token_budget=1024, projector_fit_images=16)
    train(cfg, processor, log=lambda m: None)
    ckpt = tmp_path / "run" / "ckpt"
    fitted = load_file(ckpt / "model.safetensors")
    logs = []
    train(TrainConfig(**{**cfg.__dict__, "vision_images": 32, "vision_place_weight": 1.0}), processor,
          log=logs.append)
    assert sum(m.startswith("projector fit:") for m in logs) == 1
    assert any("place head starts fresh" in m for m in logs)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["vision_images_done"] == 32
    refitted = load_file(ckpt / "model.safetensors")
    assert "place.weight" in load_file(ckpt / "heads.safetensors")
    key = "model.multi_modal_projector.linear_1.weight"
    assert not torch.equal(fitted[key], refitted[key])  # refitted on the changed tower
    assert not torch.equal(fitted["model.vision_tower.embeddings.position_embedding.weight"],
                           refitted["model.vision_tower.embeddings.position_embedding.weight"])


@pytest.mark.parametrize("frozen", ["vision", "projector"])
def test_freeze_vision_trains_only_the_lm_and_freeze_projector_the_tower_too(tmp_path, processor, frozen):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=0, pool=4, token_budget=2048,
                      warmup_samples=2, eval_n=1, eval_every_s=1e9, threads=1, vision_images=16, code_lm_samples=8,
                      code_token_budget=1024, freeze_vision=frozen == "vision",
                      freeze_projector=frozen == "projector", referent_attention=1.0, mix="dialogue")
    train(cfg, processor, log=lambda m: None)
    ckpt = tmp_path / "run" / "ckpt"
    before = load_file(ckpt / "model.safetensors")
    train(TrainConfig(**{**cfg.__dict__, "total_samples": 8}), processor, log=lambda m: None)
    after = load_file(ckpt / "model.safetensors")
    assert json.loads((ckpt / "state.json").read_text())["samples"] >= 8
    tower = [k for k in before if k.startswith("model.vision_tower.")]
    projector = [k for k in before if k.startswith("model.multi_modal_projector.")]
    lm = [k for k in before if k.startswith("model.language_model.")]
    assert projector and all(torch.equal(before[k], after[k]) for k in projector)  # a fit (and its gate) stays
    moved = [k for k in tower if not torch.equal(before[k], after[k])]
    assert tower and (not moved if frozen == "vision" else moved)
    assert any(not torch.equal(before[k], after[k]) for k in lm)


def test_cli_flags_for_place_and_frozen_vision():
    from specula.training.target.cli import parse_config

    cfg = parse_config(["--vision-place-weight", "0.5", "--freeze-vision"])
    assert cfg.vision_place_weight == 0.5 and cfg.freeze_vision and not cfg.freeze_projector
    assert parse_config(["--freeze-projector"]).freeze_projector
    cfg = parse_config([])
    assert cfg.vision_place_weight == 0.0 and not cfg.freeze_vision
    with pytest.raises(ValueError, match="vision_place_weight"):
        TrainConfig(vision_place_weight=-1.0)


def test_tower_lr_mult_gives_the_tower_its_own_rate_and_a_started_stage_keeps_its_groups(tmp_path, processor):
    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.train import _param_groups

    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer)
    base = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny")
    assert len(_param_groups(model, base)) == 2  # the layout of every earlier checkpoint
    groups = _param_groups(model, TrainConfig(**{**base.__dict__, "tower_lr_mult": 0.05}))
    tower = {id(p) for n, p in model.named_parameters() if n.startswith("model.vision_tower.")}
    assert groups[2]["lr_mult"] == 0.05 and {id(p) for p in groups[2]["params"]} == tower
    assert not tower & {id(p) for g in groups[:2] for p in g["params"]}

    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=4, pool=4, token_budget=2048,
                      warmup_samples=2, eval_n=1, eval_every_s=1e9, threads=1, vision_images=8, mix="dialogue")
    train(cfg, processor, log=lambda m: None)
    with pytest.raises(ValueError, match="parameter groups"):
        train(TrainConfig(**{**cfg.__dict__, "total_samples": 8, "tower_lr_mult": 0.1}), processor,
              log=lambda m: None)
