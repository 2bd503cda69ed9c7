"""Referent attention: targets parsed from the world's questions, the loss, and its place in the training stages."""

import json
import random

import pytest
import torch

from specula.world import generate
from specula.world.scene import make_dialogue
from specula.training.target.batching import Encoder, collate
from specula.training.target.code_stages import code_lm_loss
from specula.training.target.referents import (HEAD, PATCH_LAYER, WORD_LAYER, ReferentTarget, referent_attention_loss,
                                   referent_patches)
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, train
from specula.training.target.word_codes import WordCodes


PATCHES = [(), ("red", "square", "large", "top", "left"), ("red", "square", "large", "top", "left"), (),
           ("blue", "circle", "small", "center"), ("blue", "star", "small", "bottom", "right")]


def test_referent_patches_single_out_one_object_or_none():
    assert referent_patches("What colour is the square?", PATCHES) == [1, 2]
    assert referent_patches("Which shape is red?", PATCHES) == [1, 2]
    assert referent_patches("Where is the blue circle?", PATCHES) == [4]
    assert referent_patches("Is the blue object small or large?", PATCHES) is None  # two blue objects
    assert referent_patches("How many blue objects are there?", PATCHES) is None  # counting: no one referent
    assert referent_patches("Is the square left of the star?", PATCHES) is None  # a relation
    assert referent_patches("What colour is the triangle?", PATCHES) is None  # nothing matches
    assert referent_patches("Count the objects in the image.", PATCHES) is None


def _dialogue(seed: int):
    return make_dialogue(random.Random(f"referents/{seed}"), "vqa_dialogue", "vqa")


def test_dialogue_targets_point_at_the_answer_the_referent_and_its_words(processor):
    enc = Encoder(processor, referents=True)
    tok = processor.tokenizer
    found = 0
    for seed in range(6):
        s = _dialogue(seed)
        e = enc.encode(s)
        img = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
        questions = [s.prompt.replace("<image>", "")] + [u for u, _ in s.followups]
        answers = [s.response] + [a for _, a in s.followups]
        starts = [j for j in range(1, len(e.labels)) if e.labels[j] != -100 and e.labels[j - 1] == -100]
        assert len(starts) == len(questions)
        want = [(q, a, st) for q, a, st in zip(questions, answers, starts) if referent_patches(q, s.patch_words[0])]
        assert len(e.referents) == len(want)
        for t, (q, a, st) in zip(e.referents, want):
            assert t.query == st - 1  # the position whose logits predict the answer's first token
            assert tok.decode([int(e.input_ids[st])]).strip() == a.split()[0].strip(".")
            patches = referent_patches(q, s.patch_words[0])
            assert list(t.patches) == [img[p] for p in patches]
            words = {tok.decode([int(e.input_ids[j])]).strip() for j in t.words}
            assert words and words <= {w.strip("?.,") for w in q.lower().split()}  # named in this very question
            assert all(j > (starts[starts.index(st) - 1] if starts.index(st) else 0) for j in t.words)
            found += 1
    assert found >= 10
    assert Encoder(processor).encode(_dialogue(0)).referents == ()  # only when asked for
    assert enc.encode(generate("chart", "eval", 0)).referents == ()  # not a scene


def test_loss_is_zero_when_the_heads_look_at_the_targets_and_large_when_uniform():
    B, H, L = 2, 2, 10
    t = [[ReferentTarget(8, (2, 3), (6,))], []]
    sharp = [torch.zeros(B, H, L, L) for _ in range(2)]
    sharp[PATCH_LAYER][0, HEAD, 8, 2] = sharp[PATCH_LAYER][0, HEAD, 8, 3] = 0.5
    sharp[WORD_LAYER][0, HEAD, 8, 6] = 1.0
    assert float(referent_attention_loss(sharp, t)) < 1e-4
    uniform = [torch.full((B, H, L, L), 1.0 / L) for _ in range(2)]
    import math

    assert float(referent_attention_loss(uniform, t)) == pytest.approx(-0.5 * (math.log(0.2) + math.log(0.1)), rel=1e-4)
    assert referent_attention_loss(uniform, [[], []]) is None
    # a word hop alone: no patch term, not a -log(0) one
    word_only = [[ReferentTarget(8, (), (6,))], []]
    assert float(referent_attention_loss(sharp, word_only)) < 1e-4
    assert float(referent_attention_loss(uniform, word_only)) == pytest.approx(-math.log(0.1), rel=1e-4)


def test_a_head_saturated_elsewhere_still_gets_the_full_gradient_towards_its_set_targets():
    """A head that puts all but ~3.5e-12 of its mass on other tokens: for the set groups the loss's gradient on the
    target's score is about -1 (d(-log w)/d score = w - 1, as for any softmax cross-entropy), where an epsilon
    inside the log would give ~-3.5e-6 and the hop would never form; spread hops alike. The
    scene group keeps the recipe's -log(w + 1e-6)."""
    import math

    L = 5
    for group, kw in (("set", dict(patches=(1,), words=(), patch_layer=0)),
                      ("set", dict(patches=(), words=(1,), word_layer=0)),
                      ("set_odd", dict(patches=(1,), words=(), patch_layer=0, spread=True)),
                      ("scene", dict(patches=(1,), words=(), patch_layer=0))):
        target = ReferentTarget(3, group=group, **kw)
        scores = torch.zeros(1, 1, L, L)
        scores[0, 0, 3, 1] = -25.0  # weight w = e^-25 / (3 + e^-25) ~ 4.6e-12 on the target (query 3 sees 0..3)
        scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf")).requires_grad_(True)
        loss = referent_attention_loss([scores.softmax(-1)], [[target]], group)
        w = math.exp(-25) / (3 + math.exp(-25))
        loss.backward()
        if group == "scene":
            assert loss.item() == pytest.approx(-math.log(w + 1e-6), rel=1e-4)
            assert abs(scores.grad[0, 0, 3, 1].item()) < 1e-4
        else:
            assert loss.item() == pytest.approx(-math.log(w), rel=1e-4)
            assert scores.grad[0, 0, 3, 1].item() == pytest.approx(-1.0, abs=1e-3)


def test_code_lm_loss_adds_the_referent_term_and_it_reaches_the_first_layer(processor):
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    enc = Encoder(processor, codes=WordCodes(64), referents=True)
    batch = collate([enc.encode(_dialogue(i)) for i in range(2)], processor.tokenizer.pad_token_id)
    assert any(batch.referents)
    base = code_lm_loss(model, batch)
    parts = {}
    with_ref = code_lm_loss(model, batch, referent_weight=1.0, parts=parts)
    assert float(with_ref.detach()) > float(base.detach()) + 0.1
    assert set(parts) == {"lm", "referent"} and parts["lm"] == pytest.approx(float(base.detach()), rel=1e-4)
    assert float(with_ref.detach()) == pytest.approx(parts["lm"] + parts["referent"], rel=1e-4)  # an untrained model's heads are near uniform: a large term
    with_ref.backward()
    q0 = model.model.language_model.layers[0].self_attn.q_proj.weight.grad
    assert q0 is not None and float(q0.abs().sum()) > 0
    assert model.model.language_model.config._attn_implementation != "eager"  # restored after the forward


@pytest.mark.slow
def test_recipe_with_referent_attention_and_vision_from_another_run(tmp_path, processor):
    base = dict(arch="tiny", total_samples=8, pool=4, token_budget=2048, warmup_samples=4, eval_n=1,
                eval_every_s=1e9, ckpt_every_s=1e9, threads=1, code_lm_samples=8, code_lm_layers=1,
                code_token_budget=2048)
    first = train(TrainConfig(run_dir=str(tmp_path / "a"), vision_images=16, **base), processor, log=lambda m: None)
    logs = []
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "b"), vision_images=16, referent_attention=1.0,
                             vision_from=str(first), **{**base, "total_samples": 0}), processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["vision_from"] == str(first) and state["vision_images_done"] == 16
    assert any("loss_referent" in h for h in state["history"] if h.get("stage") == "code_lm")
    assert not any(m.startswith("vision stage:") for m in logs)  # the other run's vision images count as done
    from safetensors.torch import load_file

    a, b = load_file(first / "model.safetensors"), load_file(ckpt / "model.safetensors")
    vision = [k for k in a if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))]
    assert vision and all(torch.equal(a[k], b[k]) for k in vision)  # no joint samples: the tower is as loaded
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("model.language_model."))  # its own LM
    with pytest.raises(ValueError, match="seed"):
        train(TrainConfig(run_dir=str(tmp_path / "c"), vision_images=16, vision_from=str(first), seed=3, **base),
              processor, log=lambda m: None)


def test_cli_flags():
    from specula.training.target.cli import parse_config

    cfg = parse_config(["--referent-attention", "0.5", "--vision-from", "x/ckpt", "--code-lm-mix", "scenes", "--mix",
                        "confusable_scan", "--vis-weight", "0"])
    assert (cfg.referent_attention, cfg.vision_from, cfg.code_lm_mix) == (0.5, "x/ckpt", "scenes")
    assert cfg.mix == "confusable_scan" and cfg.vis_weight == 0.0
    default = parse_config([])
    assert default.code_lm_mix == "dialogue" and default.vis_weight == 0.5


def test_scenes_mix_is_almost_only_scene_dialogues():
    from specula.world.suites import MIXES

    w = {name: weight for name, _, _, weight in MIXES["scenes"]}
    assert (w["vqa_dialogue"] + w["vqa_dialogue_few"]) / sum(w.values()) > 0.8
    assert TrainConfig(code_lm_mix="scenes").code_lm_mix == "scenes"
    with pytest.raises(ValueError):
        TrainConfig(referent_attention=-1)
