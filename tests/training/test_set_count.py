"""Count targets: at a "how many images show a ...?" answer, a head spread over the first token and the summary
tokens of the images that show the shape; at each summary token, a head on its image's objects (targets parsed from
image-set samples and dialogues, placed forms, the loss group and its wiring, the CLI flag and the head refusal)."""

import copy
import dataclasses
import json
import random

import pytest
import torch

from loss_kit import assert_own_term_reaching_layer0

from specula.targets.processor import load_processor
from specula.world import image_sets as multi
from specula.world.placed import variant
from specula.world.scene import make_dialogue
from specula.world.vocab import COLOUR_NAMES, NUMBER_WORDS
from specula.training.target.batching import Encoder
from specula.training.target.cli import parse_config
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.referents import WORD_LAYER
from specula.training.target.set_count import (COUNT_HEAD, COUNT_LAYER, COUNT_WORD_HEAD, SUMMARY_HEAD, SUMMARY_LAYER,
                                   set_count_targets)
from specula.training.target.set_referents import object_patches
from specula.training.target.train import TrainConfig, train

T = 144  # image tokens per image


@pytest.fixture(scope="module")
def processor():
    p = copy.copy(load_processor(TOKENIZER_DIR))
    p.number_images = True  # counting targets need a token between images: the "Image n:" markers
    return p


@pytest.fixture(scope="module")
def enc(processor):
    return Encoder(processor, set_count=True)


def _count_question(seed: int):
    return next(s for s in (multi.make_multi(random.Random(f"set-count/{seed}/{i}"), "multi_image", "qa")
                            for i in range(300)) if s.kind == "multi/count")


def _dialogue(seed: int):
    return multi.make_multi_dialogue(random.Random(f"set-count/d/{seed}"), "multi_dialogue", "qa")


def _check(s, e, enc, processor) -> int:
    """Every image with objects has a summary target on the token after it; every counting turn a count target
    at the query predicting its number, spread over the first token and the summaries of the images showing the
    shape, with the word hop on the shape word."""
    tok = processor.tokenizer
    ids = e.input_ids
    image_pos = (ids == enc.image_id).nonzero()[:, 0].tolist()
    summary = [image_pos[(n + 1) * T - 1] + 1 for n in range(len(s.images))]
    targets = [t for t in e.referents if t.group == "set_count"]
    sums = [t for t in targets if not t.spread]
    assert [t.query for t in sums] == [summary[n] for n, w in enumerate(s.patch_words) if object_patches(w)]
    for t in sums:
        n = summary.index(t.query)
        assert (t.patch_layer, t.head, t.words) == (SUMMARY_LAYER, SUMMARY_HEAD, ())
        assert t.patches == tuple(image_pos[n * T + p] for p in object_patches(s.patch_words[n]))
        assert int(ids[t.query]) != enc.image_id and int(ids[t.query - 1]) == enc.image_id
        shapes = {w[1] for w in s.patch_words[n] if w and w[0] in COLOUR_NAMES}  # what --set-count-readout asks
        assert sorted(tok.decode([i]).strip() for i in t.says) == sorted(shapes)
    turns = [(s.prompt, s.response)] + list(s.followups)
    asked = [(q, a) for q, a in turns if "how many images" in q.lower()]
    counts = [t for t in targets if t.spread]
    assert len(counts) == len(asked) > 0
    for t, (q, a) in zip(counts, asked):
        assert (t.patch_layer, t.head, t.word_layer, t.word_head) == (COUNT_LAYER, COUNT_HEAD, WORD_LAYER,
                                                                      COUNT_WORD_HEAD)
        assert tok.convert_ids_to_tokens(int(ids[t.query])) == "<|assistant|>"
        assert tok.decode(ids[t.query + 1: t.query + 2]).strip() == a  # the number answered next
        shape = tok.decode(ids[t.words[0]: t.words[0] + 1]).strip()
        assert shape in q and t.words[0] < t.query
        shown = [n for n, w in enumerate(s.patch_words) if any(x and x[1] == shape for x in w)]
        assert NUMBER_WORDS[len(shown)] == a  # the summaries counted are the answer
        assert t.patches == (0,) + tuple(summary[n] for n in shown)
        assert t.says == (enc.word_id(a),)  # what --set-count-number-readout asks the count head to say
    return len(counts)


def test_a_counting_question_spreads_its_answer_over_the_first_token_and_the_matching_images(processor, enc):
    for seed in range(4):
        s = _count_question(seed)
        assert _check(s, enc.encode(s), enc, processor) == 1


def test_dialogues_get_a_target_for_each_counting_turn_and_placed_forms_keep_them(processor, enc):
    n = sum(_check(s, enc.encode(s), enc, processor) for s in (_dialogue(0), _dialogue(1)))
    assert n >= 2
    q = _count_question(5)
    base = [len(t.patches) for t in enc.encode(q).referents if t.group == "set_count"]
    for moved in (variant(q, "system"), variant(q, "lead")):
        e = enc.encode(moved)
        _check(moved, e, enc, processor)
        assert [len(t.patches) for t in e.referents if t.group == "set_count"] == base


def test_other_samples_and_sets_without_a_token_after_each_image_have_no_count_targets(processor, enc):
    rng = random.Random("set-count/none")
    which = next(s for s in (multi.make_multi(random.Random(f"w/{i}"), "multi_image", "qa") for i in range(300))
                 if s.kind == "multi/which")
    for s in (which, make_dialogue(rng, "vqa_dialogue", "vqa"), multi.make_video(rng, "video", "qa")):
        assert not [t for t in enc.encode(s).referents if t.group == "set_count"]
    q = _count_question(5)
    cut = q.prompt.rindex("<image>") + len("<image>")
    first = dataclasses.replace(q, prompt=f"{q.prompt[cut:].strip()} {q.prompt[:cut]}")  # the question, then the set
    assert not [t for t in enc.encode(first).referents if t.group == "set_count"]  # the last image: no summary token
    s = _count_question(1)
    bare = Encoder(copy.copy(load_processor(TOKENIZER_DIR)), set_count=True)  # no markers: "<image><image>"
    back_to_back = s if "Image 1:" not in s.prompt else dataclasses.replace(
        s, prompt=s.prompt.replace("Image 1: ", "").replace("Image 2: ", "").replace("Image 3: ", "")
        .replace("Image 4: ", "").replace("Image 5: ", ""))
    assert not [t for t in bare.encode(back_to_back).referents if t.group == "set_count"]
    assert set_count_targets(s, torch.zeros(8, dtype=torch.long), torch.full((8,), -100), enc.image_id,
                             enc.word_id) == ()


def test_the_count_term_is_its_own_loss_and_reaches_the_first_layer(processor, enc):
    assert_own_term_reaching_layer0(processor.tokenizer, [enc.encode(_count_question(0)), enc.encode(_dialogue(0))],
                                    "set_count")


def test_the_count_number_readout_is_its_own_loss_and_reaches_the_first_layer(processor, enc):
    assert_own_term_reaching_layer0(processor.tokenizer, [enc.encode(_count_question(2)), enc.encode(_dialogue(2))],
                                    "set_count_number_readout")


def test_the_summary_readout_is_its_own_loss_and_reaches_the_first_layer(processor, enc):
    assert_own_term_reaching_layer0(processor.tokenizer, [enc.encode(_count_question(1)), enc.encode(_dialogue(1))],
                                    "set_count_readout")


def test_the_flag_reaches_the_config_a_run_trains_the_term_and_a_narrow_lm_is_refused(processor, tmp_path):
    cfg = parse_config(["--set-count", "2", "--set-count-readout", "3"])
    assert cfg.set_count == 2.0 and cfg.set_count_readout == 3.0
    assert parse_config([]).set_count == 0.0
    with pytest.raises(ValueError, match=f"count summary hop .* sits on head {SUMMARY_HEAD}; arch 'tiny' has 2 heads"):
        train(TrainConfig(run_dir=str(tmp_path), arch="tiny", set_count=1.0), processor, log=lambda *a: None)
    base = dict(total_samples=48, pool=16, token_budget=4096, warmup_samples=2, eval_n=2, eval_every_s=0.0,
                ckpt_every_s=1e9, threads=1, vision_images=8, mix="scan_multi", number_images=True)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "deep"), arch="tiny_deep", set_count=1.0, set_count_readout=1.0,
                             **base), processor, log=lambda *a: None)
    history = json.loads((ckpt / "state.json").read_text())["history"]
    assert any(h.get("loss_set_count", 0) > 0 for h in history)
    assert any(h.get("loss_set_count_readout", 0) > 0 for h in history)
