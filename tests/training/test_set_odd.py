"""Odd-image targets: at an "odd one out" answer, a head on the odd image's object patches (targets parsed from
image-set samples and dialogues, placed forms, the loss group and its wiring, the CLI flag and the depth refusal)."""

import json
import random

import pytest
import torch

from loss_kit import assert_own_term_reaching_layer0

from specula.world import image_sets as multi
from specula.world.placed import variant
from specula.world.scene import make_dialogue
from specula.world.vocab import ORDINALS
from specula.training.target.batching import Encoder
from specula.training.target.cli import parse_config
from specula.training.target.set_referents import (ODD_HEAD, ODD_LAYER, ODD_MEAN_HEAD, ODD_MEAN_LAYER, SET_HOPS, hops_in_use,
                                       object_patches, set_odd_targets)
from specula.training.target.train import TrainConfig, train

T = 144  # image tokens per image


@pytest.fixture(scope="module")
def enc(processor):
    return Encoder(processor, set_odd=True)


def _kind(kind: str, seed: int):
    return next(s for s in (multi.make_multi(random.Random(f"set-odd/{seed}/{i}"), "multi_image", "qa")
                            for i in range(300)) if s.kind == kind)


def _odd_dialogue(seed: int):
    return next(s for s in (multi.make_multi_dialogue(random.Random(f"set-odd/d/{seed}/{i}"), "multi_dialogue", "qa")
                            for i in range(300)) if any("odd one out" in q or "different" in q for q, _ in s.followups))


def _check(s, e, enc, processor) -> int:
    """Every odd turn has two targets at the query that predicts its ordinal: the mean hop spread over every image's
    object patches, and the odd hop on that image's object patches."""
    tok = processor.tokenizer
    turns = [(s.prompt, s.response)] + list(s.followups)
    odd = [a for q, a in turns if "odd one out" in q.lower() or "different from the others" in q.lower()]
    targets = [t for t in e.referents if t.group == "set_odd"]
    assert len(targets) == 2 * len(odd) > 0
    image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
    objects = [tuple(image_pos[n * T + p] for p in object_patches(w)) for n, w in enumerate(s.patch_words)]
    for mean, t, a in zip(targets[::2], targets[1::2], odd):
        assert (mean.patch_layer, mean.head, mean.words, mean.spread) == (ODD_MEAN_LAYER, ODD_MEAN_HEAD, (), True)
        assert (t.patch_layer, t.head, t.words, t.spread) == (ODD_LAYER, ODD_HEAD, (), False)
        assert mean.query == t.query
        assert tok.convert_ids_to_tokens(int(e.input_ids[t.query])) == "<|assistant|>"
        assert tok.decode(e.input_ids[t.query + 1: t.query + 2]).strip() == a  # the ordinal answered next
        n = ORDINALS.index(a)
        assert t.patches == objects[n]
        assert mean.patches == sum(objects, ()) and len(mean.patches) > len(t.patches)
        assert max(mean.patches) < t.query
    return len(odd)


def test_an_odd_question_points_its_answer_at_the_odd_images_object(processor, enc):
    for seed in range(4):
        s = _kind("multi/odd", seed)
        assert _check(s, enc.encode(s), enc, processor) == 1


def test_dialogues_get_a_target_for_their_odd_turn_and_placed_forms_keep_it(processor, enc):
    s = _odd_dialogue(0)
    assert _check(s, enc.encode(s), enc, processor) == 1
    q = _kind("multi/odd", 5)
    base = [t for t in enc.encode(q).referents if t.group == "set_odd"]
    for moved in (variant(q, "system"), variant(q, "lead")):
        e = enc.encode(moved)
        _check(moved, e, enc, processor)
        assert [len(t.patches) for t in e.referents if t.group == "set_odd"] == [len(t.patches) for t in base]


def test_other_samples_have_no_odd_targets(processor, enc):
    rng = random.Random("set-odd/none")
    for s in (_kind("multi/which", 0), _kind("multi/count", 0), make_dialogue(rng, "vqa_dialogue", "vqa"),
              multi.make_video(rng, "video", "qa")):
        assert not [t for t in enc.encode(s).referents if t.group == "set_odd"]
    s = _kind("multi/odd", 1)
    assert set_odd_targets(s, torch.zeros(8, dtype=torch.long), torch.full((8,), -100), enc.image_id) == ()


def test_the_odd_term_is_its_own_loss_and_reaches_the_first_layer(processor, enc):
    assert_own_term_reaching_layer0(processor.tokenizer,
                                    [enc.encode(_kind("multi/odd", 0)), enc.encode(_kind("multi/which", 0))], "set_odd")


def test_the_flag_reaches_the_config_a_run_trains_the_term_and_a_shallow_lm_is_refused(processor, tmp_path):
    cfg = parse_config(["--set-odd", "3"])
    assert cfg.set_odd == 3.0
    assert parse_config([]).set_odd == 0.0
    assert hops_in_use(SET_HOPS["reader"], False, False, False, odd=True) == {
        "odd mean": (ODD_MEAN_LAYER, ODD_MEAN_HEAD), "odd": (ODD_LAYER, ODD_HEAD)}
    with pytest.raises(ValueError, match=f"odd mean hop .* sits on head {ODD_MEAN_HEAD}; arch 'tiny' has 2 heads"):
        train(TrainConfig(run_dir=str(tmp_path), arch="tiny", set_odd=1.0), processor, log=lambda *a: None)
    # odd turns are ~1 in 20 samples of the image-sets mix: this stream's first comes ~100 samples in
    base = dict(total_samples=128, pool=16, token_budget=4096, warmup_samples=2, eval_n=2, eval_every_s=0.0,
                ckpt_every_s=1e9, threads=1, vision_images=8, mix="scan_multi", number_images=True)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "deep"), arch="tiny_deep", set_odd=1.0, **base), processor,
                 log=lambda *a: None)
    history = json.loads((ckpt / "state.json").read_text())["history"]
    assert any(h.get("loss_set_odd", 0) > 0 for h in history)
