"""The VisionEncoder loads only the vision tower and projector: its features equal the full model's (LLaVA and
Qwen2.5-VL), it holds only the vision parameters, it never opens a shard of language-model weights, and it reads
the older llava-hf key names; a checkpoint missing a vision tensor is refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specula.runtime.serve import VisionEngine
from specula.runtime.engine.vision_weights import load_vision_target, resident_parameters
from specula.targets import load_target

from serve_kit import make_config


def _pixels(target, n: int = 2):
    g = torch.Generator().manual_seed(0)
    images = [target.dummy_image(g) for _ in range(n)]
    grids = [grid for _, grid in images]
    return torch.cat([p for p, _ in images]), (torch.cat(grids) if grids[0] is not None else None)


def _vision_params(target) -> int:
    groups = target.parameter_groups()
    return sum(p.numel() for p in groups["vision_tower"] + groups["projector"])


def _assert_same_features(full, vision):
    pix, grid = _pixels(full)
    want = full.encode_images(pix, "projected", image_grid_thw=grid)
    got = vision.encode_images(pix, "projected", image_grid_thw=grid)
    assert got.lengths == want.lengths and got.grid_hw == want.grid_hw
    assert torch.equal(got.features, want.features)  # same weights, same ops: bit for bit


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_llava_vision_only_equals_the_full_model_and_holds_only_vision_weights(model_dir):
    full, vision = load_target(model_dir), load_vision_target(model_dir)
    _assert_same_features(full, vision)
    held, total = resident_parameters(vision.model), sum(p.numel() for p in full.model.parameters())
    assert held == _vision_params(full)
    assert held < 0.5 * total, (held, total)  # the tiny LM is the larger part, as in real VLMs
    assert all(p.is_meta for p in vision.model.model.language_model.parameters())
    assert vision.model.lm_head.weight.is_meta


def test_vision_engine_from_config_is_vision_only(model_dir, processor):
    from specula.world import generate

    engine = VisionEngine.from_config(make_config(model_dir))
    assert resident_parameters(engine.target.model) == _vision_params(load_target(model_dir))
    image = generate("vqa", "eval", 0).images[0]
    pix = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    want = VisionEngine(load_target(model_dir)).encode(pix)
    assert torch.equal(engine.encode(pix).features, want.features)


def test_qwen2_5_vl_vision_only_equals_the_full_model(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(tmp_path)
    full, vision = load_target(tmp_path), load_vision_target(tmp_path)
    _assert_same_features(full, vision)
    assert resident_parameters(vision.model) == _vision_params(full)


def test_sharded_checkpoint_with_old_key_names_never_opens_the_language_model_shard(model_dir, tmp_path):
    """llava-hf's layout: vision_tower.vision_model.*; weights in two shards, the LM's one deleted."""
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = _tensors(model_dir)
    lm = {k: v for k, v in tensors.items() if k.startswith(("language_model", "lm_head"))}
    vis = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
           for k, v in tensors.items() if k not in lm}
    assert lm and vis
    save_file(vis, str(tmp_path / "vision.safetensors"), metadata={"format": "pt"})
    weight_map = {**{k: "vision.safetensors" for k in vis}, **{k: "lm.safetensors" for k in lm}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # lm.safetensors does not exist: opening it would fail
    _assert_same_features(load_target(model_dir), load_vision_target(tmp_path))


def test_checkpoint_without_safetensors_falls_back_to_a_full_load_then_drops_the_lm(model_dir, tmp_path):
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    torch.save(_tensors(model_dir), tmp_path / "pytorch_model.bin")
    full, vision = load_target(model_dir), load_vision_target(tmp_path)
    _assert_same_features(full, vision)
    assert resident_parameters(vision.model) == _vision_params(full)
    # packed for oneDNN as a CPU target is by default: the tower's linears only, none of the dropped LM's
    from specula.targets.packed_linear import PackedLinear, available, packed_count

    assert vision.linears_packed == packed_count(vision.model) and (vision.linears_packed > 0) == available()
    lm = [vision.model.model.language_model, vision.model.lm_head]
    assert not any(type(m) is PackedLinear for part in lm for m in part.modules())


def test_missing_vision_weight_is_named(model_dir, tmp_path):
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = _tensors(model_dir)
    gone = next(k for k in tensors if k.startswith("multi_modal_projector"))
    save_file({k: v for k, v in tensors.items() if k != gone}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks vision weights.*multi_modal_projector"):
        load_vision_target(tmp_path)
