"""Set referents: addressing targets parsed from image-set samples, their loss group and layers, and the training step."""

import dataclasses
import math
import random

import pytest
import torch

from specula.world import image_sets as multi
from specula.world.placed import variant
from specula.world.scene import make_dialogue
from specula.world.vocab import ORDINALS
from specula.training.target.batching import Encoder, collate
from specula.training.target.referents import HEAD, ReferentTarget, referent_attention_loss
from specula.training.target.set_referents import SET_PATCH_LAYER, SET_WORD_LAYER, object_patches, set_referent_targets
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, forward_losses, train

T = 144  # image tokens per image


@pytest.fixture(scope="module")
def enc(processor):
    return Encoder(processor, set_referents=True)


def _which(seed: int):
    return next(s for s in (multi.make_multi(random.Random(f"set-refs/{seed}/{i}"), "multi_image", "qa")
                            for i in range(200)) if s.kind == "multi/which")


def _image_of(e, enc, pos: int) -> tuple[int, int]:
    """(image index, patch index) of the image token at ``pos``."""
    img = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
    i = img.index(pos)
    return i // T, i % T


def _check_which(s, e, enc, processor):
    tok = processor.tokenizer
    questions = [s.prompt] + [u for u, _ in s.followups]
    answers = [s.response] + [a for _, a in s.followups]
    named = [(q, a) for q, a in zip(questions, answers) if any(f"the {o} image" in q.lower() for o in ORDINALS)]
    assert len(e.referents) == len(named) > 0
    for t, (q, a) in zip(e.referents, named):
        assert (t.group, t.patch_layer, t.word_layer) == ("set", SET_PATCH_LAYER, SET_WORD_LAYER)
        assert tok.convert_ids_to_tokens(int(e.input_ids[t.query])) == "<|assistant|>"
        assert tok.decode(e.input_ids[t.query + 1: t.query + 2]).strip() == a  # the colour answered next
        (w,) = t.words
        ordinal = tok.decode(e.input_ids[w: w + 1]).strip()
        assert f"the {ordinal} image" in q.lower() and w < t.query
        n = ORDINALS.index(ordinal)
        places = [_image_of(e, enc, p) for p in t.patches]
        assert {i for i, _ in places} == {n}  # every patch in the named image
        assert sorted(j for _, j in places) == object_patches(s.patch_words[n])  # all of its object patches
        assert all(s.patch_words[n][j][0] == a for _, j in places)  # ... and they show the answer's colour


def test_which_questions_point_at_the_answer_the_ordinal_and_the_named_images_object(processor, enc):
    for seed in range(5):
        s = _which(seed)
        _check_which(s, enc.encode(s), enc, processor)


def test_dialogues_get_one_target_per_which_turn(processor, enc):
    seen = 0
    for seed in range(6):
        s = multi.make_multi_dialogue(random.Random(f"set-refs/dialogue/{seed}"), "multi_dialogue", "qa")
        e = enc.encode(s)
        if e.referents:
            _check_which(s, e, enc, processor)
            seen += len(e.referents)
    assert seen >= 6


def test_placed_forms_keep_their_targets(processor, enc):
    s = _which(7)
    base = enc.encode(s).referents[0]
    cut = s.prompt.rindex("<image>") + len("<image>")  # the images (with or without markers), then the question
    first = dataclasses.replace(s, prompt=s.prompt[cut:].strip() + " " + s.prompt[:cut])
    for moved in (variant(s, "system"), variant(s, "lead"), first):
        e = enc.encode(moved)
        _check_which(moved, e, enc, processor)
        assert len(e.referents[0].patches) == len(base.patches)
    first = enc.encode(first)
    (w,) = first.referents[0].words
    assert w < int((first.input_ids == enc.image_id).nonzero()[0, 0])  # the ordinal now comes before the images


def test_scan_caption_lines_point_at_their_images(processor, enc):
    tok = processor.tokenizer
    s = multi.make_multi(random.Random("set-refs/caption"), "multi_image", "caption", k=3, scan=True)
    e = enc.encode(s)
    lines = {}
    for t in e.referents:
        (w,) = t.words
        n = int(tok.decode(e.input_ids[w: w + 1]).strip()) - 1
        assert tok.convert_ids_to_tokens(int(e.input_ids[w - 1])) == "▁Image" and e.labels[w] != -100
        assert {_image_of(e, enc, p)[0] for p in t.patches} == {n}
        assert sorted(_image_of(e, enc, p)[1] for p in t.patches) == object_patches(s.patch_words[n])
        lines.setdefault(n, []).append(t.query)
    assert sorted(lines) == [0, 1, 2]
    for n, qs in lines.items():  # from "has" to the position predicting the line's last word
        text = tok.decode(e.input_ids[qs[0]: qs[-1] + 2]).strip()
        assert qs == list(range(qs[0], qs[-1] + 1))
        assert text.startswith("has ") and s.response.split(". ")[n].rstrip(".").endswith(text)


def test_other_samples_have_no_set_targets(processor, enc):
    rng = random.Random("set-refs/none")
    assert enc.encode(make_dialogue(rng, "vqa_dialogue", "vqa")).referents == ()
    assert enc.encode(multi.make_video(rng, "video", "qa")).referents == ()
    odd = next(s for s in (multi.make_multi(rng, "multi_image", "qa") for _ in range(100)) if s.kind == "multi/odd")
    assert enc.encode(odd).referents == ()
    assert Encoder(processor).encode(_which(0)).referents == ()  # only when asked for
    s = _which(1)  # the image tokens do not match the images (one image's tokens cut): no targets, not wrong ones
    e = enc.encode(s)
    keep = torch.ones(len(e.input_ids), dtype=torch.bool)
    keep[(e.input_ids == enc.image_id).nonzero()[-T:, 0]] = False
    assert set_referent_targets(s, e.input_ids[keep], e.labels[keep], enc.image_id, enc.word_id) == ()


def test_the_loss_reads_each_groups_own_layers():
    B, H, L = 1, 2, 10
    scene = ReferentTarget(8, (2,), (6,))
    sets = ReferentTarget(8, (3, 4), (5,), patch_layer=4, word_layer=2, group="set")
    att = [torch.full((B, H, L, L), 1.0 / L) for _ in range(5)]
    att[4][0, HEAD, 8, 3] = att[4][0, HEAD, 8, 4] = 0.5
    att[2][0, HEAD, 8, 5] = 1.0
    assert float(referent_attention_loss(att, [[scene, sets]], "set")) < 1e-4
    assert float(referent_attention_loss(att, [[scene, sets]])) == pytest.approx(-math.log(0.1), rel=1e-4)
    assert referent_attention_loss(att, [[scene]], "set") is None


def _deep_tiny(processor):
    return build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer, seed=0)


def test_the_set_term_is_its_own_loss_and_trains_the_layers_below_the_hops(processor, enc):
    torch.manual_seed(0)
    model = _deep_tiny(processor)
    batch = collate([enc.encode(_which(0)), enc.encode(make_dialogue(random.Random(0), "vqa_dialogue", "vqa"))],
                    processor.tokenizer.pad_token_id)
    losses = forward_losses(model, batch, TrainConfig(run_dir="x", set_referents=1.0, freeze_vision=True))
    assert "referent" not in losses and float(losses["set_referent"].detach()) > 0
    losses["set_referent"].backward()
    grads = [p.grad for n, p in model.named_parameters() if "language_model.layers.0." in n and p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    off = forward_losses(model, batch, TrainConfig(run_dir="x", freeze_vision=True))
    assert "set_referent" not in off
    with pytest.raises(ValueError, match="set_referents"):
        TrainConfig(run_dir="x", set_referents=-1.0)


def test_training_refuses_an_lm_too_shallow_for_the_hops(processor, tmp_path):
    with pytest.raises(ValueError, match="deeper than layer"):
        train(TrainConfig(run_dir=str(tmp_path), arch="tiny", set_referents=1.0), processor, log=lambda *a: None)


def test_the_set_term_takes_part_in_the_joint_stage(tmp_path, processor):
    """The same short run with ``set_referents`` 1 and 1e-12 ends with other weights (both run eager attention, whose
    numerics differ from the default kernel's, so the faint run is the fair reference), and logs its term."""
    import json

    from safetensors.torch import load_file

    base = dict(arch="tiny_deep", total_samples=16, pool=16, token_budget=4096, warmup_samples=4, eval_n=2,
                eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=16, mix="scan_multi")
    weights, history = {}, {}
    for name, w in (("faint", 1e-12), ("refs", 1.0)):
        ckpt = train(TrainConfig(run_dir=str(tmp_path / name), set_referents=w, **base), processor,
                     log=lambda m: None)
        weights[name] = load_file(ckpt / "model.safetensors")
        history[name] = json.loads((ckpt / "state.json").read_text())["history"]
    lm = [k for k in weights["faint"] if "language_model.layers.0." in k]
    assert any(not torch.equal(weights["faint"][k], weights["refs"][k]) for k in lm)
    assert any(h.get("loss_set_referent", 0) > 0 for h in history["refs"])


def test_a_spread_hop_wants_the_mass_shared_evenly():
    B, H, L = 1, 2, 10
    t = [[ReferentTarget(8, (0, 2, 5), (), patch_layer=1, group="set_odd", head=1, spread=True)]]
    even = [torch.zeros(B, H, L, L) for _ in range(2)]
    even[1][0, 1, 8, [0, 2, 5]] = 1.0 / 3
    assert float(referent_attention_loss(even, t, "set_odd")) == pytest.approx(math.log(3), rel=1e-4)
    lumped = [torch.zeros(B, H, L, L) for _ in range(2)]
    lumped[1][0, 1, 8, 0] = 1.0  # all of it on the first token: the summed mass would be perfect, the spread is not
    assert float(referent_attention_loss(lumped, t, "set_odd")) > 5 * math.log(3)
    assert referent_attention_loss(even, t, "set") is None
