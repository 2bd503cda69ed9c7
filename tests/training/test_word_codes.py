"""The word-code recipe: fixed codes per word, the shallow-then-grown code LM stage, the codes regression."""

import json

import pytest
import torch

from specula.world import generate
from specula.training.target.batching import Encoder, collate
from specula.training.target.code_stages import code_answer_hits, code_embeds, code_vision_loss, make_identity, shallow
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, train
from specula.training.target.word_codes import WordCodes


def test_codes_are_fixed_unit_vectors_and_patches_sum_them():
    a, b = WordCodes(64, seed=0), WordCodes(64, seed=0)
    torch.testing.assert_close(a.code("star"), b.code("star"))  # deterministic across instances
    assert abs(float(a.code("star").norm()) - 1) < 1e-5
    assert abs(float(a.code("star") @ a.code("square"))) < 0.6  # distinct words are not aligned
    assert not torch.equal(WordCodes(64, seed=1).code("star"), a.code("star"))
    torch.testing.assert_close(a.patch(("red", "star")), a.code("red") + a.code("star"))
    assert float(a.patch(()).abs().sum()) == 0  # background
    with pytest.raises(ValueError):
        WordCodes(0)


def test_encoder_carries_codes_that_match_the_patch_words(processor):
    codes = WordCodes(64)
    s = generate("vqa", "eval", 5)
    e = Encoder(processor, codes=codes).encode(s)
    assert e.patch_codes.shape == (1, 144, 64)
    j = next(j for j, w in enumerate(s.patch_words[0]) if w)
    torch.testing.assert_close(e.patch_codes[0, j], codes.patch(tuple(s.patch_words[0][j])))
    assert Encoder(processor).encode(s).patch_codes is None
    batch = collate([e, Encoder(processor, codes=codes).encode(generate("text", "eval", 1))], processor.tokenizer.pad_token_id)
    assert batch.patch_codes.shape == (1, 144, 64)


def test_code_embeds_replace_exactly_the_image_positions(processor):
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    s = generate("vqa", "eval", 2)
    e = Encoder(processor, codes=WordCodes(64)).encode(s)
    ids = e.input_ids[None]
    x = code_embeds(model, ids, e.patch_codes)  # [1, L, H]
    img = ids[0] == model.config.image_token_id
    torch.testing.assert_close(x[0, img], e.patch_codes[0])
    torch.testing.assert_close(x[0, ~img], model.get_input_embeddings()(ids)[0, ~img])


def test_identity_layers_preserve_the_shallow_function(processor):
    """After make_identity the full-depth LM computes what its first k layers computed."""
    model = build_model(TargetArch(vision_hidden=32, vision_layers=1, vision_heads=2, lm_hidden=64, lm_layers=4,
                                   lm_heads=2, lm_kv_heads=2, lm_ffn=128), processor.tokenizer, seed=0).eval()
    lm = model.model.language_model
    ids = torch.tensor([[1, 40, 50, 60, 70]])
    with torch.no_grad():
        with shallow(lm, 2):
            want = lm(input_ids=ids).last_hidden_state
        full = lm(input_ids=ids).last_hidden_state
        assert not torch.allclose(want, full)  # the last two layers do something before
        assert lm.config.num_hidden_layers == 4  # restored
        assert make_identity(lm, 2) == 2
        torch.testing.assert_close(lm(input_ids=ids).last_hidden_state, want)


def test_code_vision_loss_is_zero_only_at_the_codes():
    codes = torch.randn(2, 3, 8)
    assert float(code_vision_loss(codes.clone(), codes)) == 0
    assert float(code_vision_loss(torch.zeros_like(codes), codes)) > 0


def test_code_answers_use_the_codes(processor):
    """A model whose LM is untrained answers something; blank (zero) codes change what the LM sees."""
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    samples = [generate("vqa", "eval", i) for i in range(2)]
    codes = WordCodes(64)
    hits = code_answer_hits(model, processor, codes, samples, max_new_tokens=2)
    assert len(hits) == 2 and all(isinstance(h, bool) for h in hits)
    e = Encoder(processor, codes=codes).encode(samples[0])
    ids = e.input_ids[None]
    lm = model.model.language_model
    with torch.no_grad():
        a = lm(inputs_embeds=code_embeds(model, ids, e.patch_codes)).last_hidden_state[0, -1]
        b = lm(inputs_embeds=code_embeds(model, ids, torch.zeros_like(e.patch_codes))).last_hidden_state[0, -1]
    assert not torch.allclose(a, b)


def test_config_rejects_bad_code_settings():
    with pytest.raises(ValueError):
        TrainConfig(code_lm_samples=-1)
    with pytest.raises(ValueError):
        TrainConfig(code_lm_mix="nope")
    assert TrainConfig(code_lm_samples=10).uses_codes and not TrainConfig().uses_codes


@pytest.mark.slow
def test_code_recipe_runs_grows_and_resumes(tmp_path, processor):
    """Code LM stage (2 of 4 layers), then growth, vision stage on codes, joint stage; a second call resumes."""
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=24, pool=12, token_budget=2048,
                      warmup_samples=8, eval_n=2, eval_every_s=1e9, ckpt_every_s=0.0, threads=1, vision_images=16,
                      code_lm_samples=24, code_lm_layers=1, code_token_budget=2048)
    logs = []
    ckpt = train(cfg, processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["code_lm_done"] and state["code_lm_samples"] >= 24 and state["code_lm_grown_from"] == 1
    assert any(h.get("stage") == "code_lm" and "code_vqa_exact_blank" in h for h in state["history"])
    assert "vision_stage_at" in state and state["samples"] >= 24
    assert any("start as identities" in m for m in logs)
    assert not (ckpt / "code_optimizer.pt").exists()  # the stage's optimizer is gone once the stage is done
    assert state["vision_images_done"] == 16
    cfg2 = TrainConfig(**{**cfg.__dict__, "total_samples": 36, "vision_images": 24, "vision_lr": 2e-3})
    train(cfg2, processor, log=logs.append)
    state2 = json.loads((ckpt / "state.json").read_text())
    assert state2["samples"] >= 36 and state2["code_lm_samples"] == state["code_lm_samples"]
    assert state2["vision_images_done"] == 24 and state2["vision_stage_at"] >= 24  # extended on resume
    assert sum(m.startswith("vision stage:") for m in logs) == 2  # once per call


@pytest.mark.slow
def test_code_lm_stage_resumes_mid_stage(tmp_path, processor):
    """A run stopped inside the code LM stage continues there, with the stage's optimizer restored."""
    base = dict(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=12, pool=2, token_budget=2048,
                warmup_samples=8, eval_n=1, eval_every_s=1e9, ckpt_every_s=0.0, threads=1, vision_images=8,
                code_token_budget=2048)
    from specula.training.target import code_stages

    calls = []
    real = code_stages.code_lm_loss

    def stop_after_two(model, batch, *args):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(model, batch, *args)

    code_stages.code_lm_loss = stop_after_two
    try:
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(**base, code_lm_samples=48), processor, log=lambda m: None)
    finally:
        code_stages.code_lm_loss = real
    ckpt = tmp_path / "run" / "ckpt"
    mid = json.loads((ckpt / "state.json").read_text())
    assert 0 < mid["code_lm_samples"] < 48 and (ckpt / "code_optimizer.pt").exists()
    logs = []
    train(TrainConfig(**base, code_lm_samples=48), processor, log=logs.append)
    done = json.loads((ckpt / "state.json").read_text())
    assert any("resumed" in m for m in logs) and done["code_lm_done"] and done["code_lm_samples"] >= 48


@pytest.mark.slow
def test_vision_stage_resumes_mid_stage(tmp_path, processor):
    """A run stopped inside the vision stage continues there (images done and the stage's optimizer restored)."""
    base = dict(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=4, pool=2, token_budget=2048,
                warmup_samples=2, eval_n=1, eval_every_s=1e9, ckpt_every_s=0.0, threads=1, vision_images=96)  # batches of 32
    from specula.training.target import vision_heads

    calls = []
    real = vision_heads.VisionHeads.loss

    def stop_after_two(self, feats, classes):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(self, feats, classes)

    vision_heads.VisionHeads.loss = stop_after_two
    try:
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(**base), processor, log=lambda m: None)
    finally:
        vision_heads.VisionHeads.loss = real
    ckpt = tmp_path / "run" / "ckpt"
    mid = json.loads((ckpt / "state.json").read_text())
    assert mid["vision_images_done"] == 64 and "vision_stage_at" not in mid
    assert (ckpt / "vision_optimizer.pt").exists()
    logs = []
    train(TrainConfig(**base), processor, log=logs.append)
    done = json.loads((ckpt / "state.json").read_text())
    seen = [m for m in logs if m.startswith("vision stage:")]
    assert len(seen) == 1 and int(seen[0].split()[2]) == 96 - 64  # only what was left
    assert done["vision_images_done"] == 96 and "vision_stage_at" in done
    assert not (ckpt / "vision_optimizer.pt").exists()


def test_cli_flags_reach_the_train_config():
    from specula.training.target.cli import parse_config

    cfg = parse_config(["--run-dir", "r", "--code-lm-samples", "500", "--code-lm-layers", "2", "--code-lm-lr", "2e-3",
                        "--code-token-budget", "512", "--aux-out", "0", "--mix", "dialogue", "--lr", "3e-4",
                        "--vision-lr", "1e-3"])
    assert (cfg.code_lm_samples, cfg.code_lm_layers, cfg.code_lm_lr, cfg.code_token_budget) == (500, 2, 2e-3, 512)
    assert (cfg.aux_out, cfg.mix, cfg.lr, cfg.run_dir, cfg.vision_lr) == (0.0, "dialogue", 3e-4, "r", 1e-3)
    assert cfg.uses_codes and cfg.vision_pos_lr_mult == 1.0
    assert parse_config(["--vision-pos-lr-mult", "30"]).vision_pos_lr_mult == 30.0
    assert not parse_config([]).uses_codes


def test_joint_losses_regress_codes_and_can_drop_aux_out(processor):
    from specula.training.target.train import forward_losses
    from specula.training.target.vision_heads import tower_features

    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    s = generate("vqa", "eval", 4)
    with_codes = collate([Encoder(processor, codes=WordCodes(64)).encode(s)], processor.tokenizer.pad_token_id)
    plain = collate([Encoder(processor).encode(s)], processor.tokenizer.pad_token_id)
    a = forward_losses(model, with_codes, TrainConfig(arch="tiny", aux_out=0.0))
    assert "aux_out" not in a
    _, img = tower_features(model, with_codes.pixel_values)
    torch.testing.assert_close(a["aux_in"], code_vision_loss(img, with_codes.patch_codes))
    b = forward_losses(model, plain, TrainConfig(arch="tiny"))
    assert "aux_out" in b and not torch.allclose(a["aux_in"], b["aux_in"])
    torch.testing.assert_close(a["lm"], b["lm"])


def test_vision_stage_boosts_the_position_embeddings_rate(processor):
    """``pos_lr_mult`` moves the tower's position embeddings that many times faster than the rest (Adam's step is
    about the learning rate per entry), and a saved optimizer of the same stage keeps its moments."""
    from specula.training.target.vision_heads import VisionHeads, vision_stage

    moved, opt_states = {}, {}
    for mult in (1.0, 30.0):
        model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
        heads = VisionHeads(model.config.vision_config.hidden_size)
        pe = model.model.vision_tower.embeddings.position_embedding.weight
        before = pe.detach().clone()
        keep = {}
        vision_stage(model, heads, Encoder(processor), 64, 0, lr=1e-4, log=lambda m: None, pos_lr_mult=mult,
                     checkpoint=lambda done, sd: keep.update(sd=sd), ckpt_every_s=0.0, batch_images=32)
        moved[mult] = float((pe.detach() - before).abs().mean())
        opt_states[mult] = keep["sd"]
    assert moved[30.0] > 10 * moved[1.0]
    groups = opt_states[30.0]["param_groups"]
    assert [g["lr_mult"] for g in groups] == [1.0, 30.0] and groups[1]["lr"] == pytest.approx(30 * 1e-4)


def test_tower_features_feed_the_projector_as_llava_does(processor):
    """``tower_features`` gives the projector what HF LLaVA gives it, a layer list included (concatenated), and the
    last layer to the dense heads."""
    from specula.training.target.vision_heads import tower_features

    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0).eval()
    enc = Encoder(processor).encode(generate("vqa", "eval", 3, 0))
    for layers in (-1, [-1, 0]):
        if isinstance(layers, list):
            l1 = model.model.multi_modal_projector.linear_1
            model.model.multi_modal_projector.linear_1 = torch.nn.Linear(2 * l1.in_features, l1.out_features)
        model.config.vision_feature_layer = layers
        with torch.no_grad():
            feats, img = tower_features(model, enc.pixel_values)
            ref = model.model.get_image_features(pixel_values=enc.pixel_values, vision_feature_layer=layers,
                                                 return_dict=True)
        torch.testing.assert_close(img[0], ref.pooler_output[0])
        assert feats.shape[-1] == model.config.vision_config.hidden_size


def test_raising_code_lm_samples_extends_the_code_stage(tmp_path, processor):
    base = dict(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=0, pool=2, token_budget=2048,
                warmup_samples=2, eval_n=1, eval_every_s=1e9, threads=1, vision_images=0, code_lm_samples=8,
                code_lm_layers=1, code_token_budget=1024)
    train(TrainConfig(**base), processor, log=lambda m: None)
    ckpt = tmp_path / "run" / "ckpt"
    first = json.loads((ckpt / "state.json").read_text())
    assert first["code_lm_done"] and 8 <= first["code_lm_samples"] < 16
    logs = []
    train(TrainConfig(**{**base, "code_lm_samples": 16}), processor, log=logs.append)
    second = json.loads((ckpt / "state.json").read_text())
    assert second["code_lm_samples"] >= 16 and second["code_lm_grown_from"] == 1
    assert not any("start as identities" in m for m in logs)  # grown once only
