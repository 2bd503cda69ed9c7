"""Set marks: each object patch of a numbered image set attends to its image's ``Image n:`` number (targets, loss,
training with ``number_images``, and the prompt form carried to checkpoints and exports)."""

import json
import random

import pytest
import torch

from specula.targets.processor import load_processor
from specula.world import image_sets as multi
from specula.world.scene import make_dialogue
from specula.training.target.batching import Encoder, collate
from specula.training.build import export
from specula.training.target.evaluate import load_checkpoint
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.set_referents import (MARK_REACH, SET_HOPS, SET_MARK_HEAD, SET_MARK_LAYER, hops_in_use,
                                                   object_patches, set_mark_targets)
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, forward_losses, train

T = 144  # image tokens per image


@pytest.fixture(scope="module")
def numbering():
    proc = load_processor(TOKENIZER_DIR)
    proc.number_images = True
    return proc


def _sets(n: int):
    return [multi.make_multi(random.Random(f"set-marks/{i}"), "multi_image", "qa") for i in range(n)]


def test_each_object_patch_points_at_its_images_number(numbering):
    enc = Encoder(numbering, set_marks=True)
    tok = numbering.tokenizer
    samples = _sets(8)
    assert {"Image 1:" in s.prompt for s in samples} == {True, False}  # bare and marked prompts alike
    for s in samples:
        e = enc.encode(s)
        img = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
        want = [(n, p) for n, words in enumerate(s.patch_words) for p in object_patches(words)]
        assert len(e.referents) == len(want) > 0
        for t, (n, p) in zip(e.referents, want):
            assert t.query == img[n * T + p] and t.words == () and not t.spread
            assert (t.group, t.patch_layer, t.head) == ("set_mark", SET_MARK_LAYER, SET_MARK_HEAD)
            (m,) = t.patches
            assert tok.convert_ids_to_tokens(e.input_ids[m - 1: m + 1].tolist()) == ["▁Image", f"▁{n + 1}"]
            assert 0 < img[n * T] - m <= MARK_REACH  # just before the image's first token


def test_unnumbered_and_other_samples_have_no_marks(numbering):
    plain = Encoder(load_processor(TOKENIZER_DIR), set_marks=True)
    bare = next(s for s in _sets(40) if "Image 1:" not in s.prompt)
    assert plain.encode(bare).referents == ()  # no markers, no targets
    rng = random.Random("set-marks/none")
    enc = Encoder(numbering, set_marks=True)
    assert enc.encode(make_dialogue(rng, "vqa_dialogue", "vqa")).referents == ()
    assert enc.encode(multi.make_video(rng, "video", "qa")).referents == ()  # frames: numbered, but not a set
    assert set_mark_targets(make_dialogue(rng, "vqa_dialogue", "vqa"), torch.zeros(4, dtype=torch.long), 3,
                            lambda w: 5) == ()


def test_the_mark_term_is_its_own_loss_and_reaches_the_first_layer(numbering):
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), numbering.tokenizer, seed=0)
    enc = Encoder(numbering, set_marks=True)
    batch = collate([enc.encode(s) for s in _sets(2)], numbering.tokenizer.pad_token_id)
    losses = forward_losses(model, batch, TrainConfig(run_dir="x", set_marks=1.0, freeze_vision=True))
    assert float(losses["set_mark"].detach()) > 0 and "set_referent" not in losses
    losses["set_mark"].backward()
    grads = [p.grad for n, p in model.named_parameters() if "language_model.layers.0." in n and p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    assert "set_mark" not in forward_losses(model, batch, TrainConfig(run_dir="x", freeze_vision=True))
    with pytest.raises(ValueError, match="set_marks"):
        TrainConfig(run_dir="x", set_marks=-1.0)


def test_a_numbered_run_trains_the_term_and_keeps_its_prompt_form(tmp_path):
    """A short run with ``set_marks`` 1 ends with other weights than one at 1e-12 and logs the term; its checkpoint
    and its export number image sets (``number_images``) while the default run's do not."""
    from safetensors.torch import load_file

    base = dict(arch="tiny_deep", total_samples=16, pool=16, token_budget=4096, warmup_samples=4, eval_n=2,
                eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=16, mix="scan_multi")
    ckpts = {name: train(TrainConfig(run_dir=str(tmp_path / name), set_marks=w, number_images=numbered, **base),
                         load_processor(TOKENIZER_DIR), log=lambda m: None)
             for name, w, numbered in (("faint", 1e-12, True), ("marks", 1.0, True), ("plain", 0.0, False))}
    faint, marks = (load_file(ckpts[k] / "model.safetensors") for k in ("faint", "marks"))
    lm = [k for k in faint if "language_model.layers.0." in k]
    assert any(not torch.equal(faint[k], marks[k]) for k in lm)
    state = json.loads((ckpts["marks"] / "state.json").read_text())
    assert state["config"]["number_images"] and any(h.get("loss_set_mark", 0) > 0 for h in state["history"])
    assert load_checkpoint(str(ckpts["marks"]))[1].number_images
    assert not load_checkpoint(str(ckpts["plain"]))[1].number_images
    out = export(ckpts["marks"], tmp_path / "exported")
    assert load_processor(out).number_images
    assert json.loads((out / "processor_config.json").read_text())["number_images"] is True


def test_shallow_hops_sit_on_the_scene_lookups_heads(numbering):
    """``set_hops="shallow"``: the ordinal and patch hops on layers 0 and 1 (head 0, as training/target/referents.py's scene
    lookups), the mark hop on layer 0; the positions are the deep placement's; a tiny 2-layer LM may train them."""
    from specula.training.target.referents import HEAD, PATCH_LAYER, WORD_LAYER
    from specula.training.target.set_referents import SET_HOPS

    which = next(s for s in _sets(60) if s.kind == "multi/which")
    deep, shallow = (Encoder(numbering, set_referents=True, set_marks=True, set_hops=h).encode(which).referents
                     for h in ("deep", "shallow"))
    assert [(t.query, t.patches, t.words, t.group) for t in deep] == \
        [(t.query, t.patches, t.words, t.group) for t in shallow]
    for t in shallow:
        if t.group == "set":
            assert (t.word_layer, t.patch_layer, t.head) == (WORD_LAYER, PATCH_LAYER, HEAD)
        else:
            assert (t.patch_layer, t.head) == (SET_HOPS["shallow"].mark_layer, SET_MARK_HEAD)
    assert SET_HOPS["shallow"].mark_layer < PATCH_LAYER  # the number is on the patches before the patch hop looks
    with pytest.raises(ValueError, match="set_hops"):
        TrainConfig(run_dir="x", set_hops="middle")


def test_reader_hops_fetch_the_ordinal_on_a_head_of_its_own(numbering):
    """``set_hops="reader"``: the shallow layers and patch head, the ordinal hop on head ``READER_WORD_HEAD`` of
    layer 0 (not the scene word hop's head 0), and the loss reads each hop from its own head."""
    from specula.training.target.referents import HEAD, PATCH_LAYER, WORD_LAYER, referent_attention_loss
    from specula.training.target.set_referents import READER_WORD_HEAD, SET_HOPS

    which = next(s for s in _sets(60) if s.kind == "multi/which")
    shallow, reader = (Encoder(numbering, set_referents=True, set_marks=True, set_hops=h).encode(which).referents
                       for h in ("shallow", "reader"))
    assert [(t.query, t.patches, t.words, t.group, t.patch_layer, t.word_layer) for t in shallow] == \
        [(t.query, t.patches, t.words, t.group, t.patch_layer, t.word_layer) for t in reader]
    sets = [t for t in reader if t.group == "set"]
    assert sets and READER_WORD_HEAD != HEAD
    assert {(t.word_layer, t.word_head, t.patch_layer, t.head) for t in sets} == \
        {(WORD_LAYER, READER_WORD_HEAD, PATCH_LAYER, HEAD)}
    assert {t.word_head for t in shallow if t.group == "set"} == {0}
    assert all(t.head == SET_HOPS["reader"].mark_head for t in reader if t.group == "set_mark")

    t = sets[0]  # one target, one row: the loss from attention on the right heads vs on the swapped heads
    L, heads = t.query + 1, READER_WORD_HEAD + 1

    def attentions(word_head: int) -> list[torch.Tensor]:
        att = [torch.full((1, heads, L, L), 1e-9) for _ in range(PATCH_LAYER + 1)]
        att[WORD_LAYER][0, word_head, t.query, t.words[0]] = 1.0
        att[PATCH_LAYER][0, HEAD, t.query, t.patches[0]] = 1.0
        return att

    right = referent_attention_loss(attentions(READER_WORD_HEAD), [[t]], group="set")
    wrong = referent_attention_loss(attentions(HEAD), [[t]], group="set")
    assert right.item() < 1e-4 < 5.0 < wrong.item()


def test_a_shallow_run_fits_a_two_layer_lm(tmp_path, numbering):
    """Deep hops need more than 4 layers and the mark hop a third head; shallow set referents train in a tiny LM
    (2 layers, 2 heads)."""
    base = dict(arch="tiny", total_samples=8, pool=8, token_budget=4096, warmup_samples=2, eval_n=2,
                eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=8, mix="scan_multi")
    with pytest.raises(ValueError, match="deeper than layer"):
        train(TrainConfig(run_dir=str(tmp_path / "deep"), set_referents=1.0, **base), numbering, log=lambda m: None)
    with pytest.raises(ValueError, match="has 2 heads"):
        train(TrainConfig(run_dir=str(tmp_path / "heads"), set_marks=1.0, set_hops="shallow", **base), numbering,
              log=lambda m: None)
    with pytest.raises(ValueError, match="has 2 heads"):  # the reader's ordinal head is head 4
        train(TrainConfig(run_dir=str(tmp_path / "reader"), set_referents=1.0, set_hops="reader", **base), numbering,
              log=lambda m: None)
    # the reader's readout alone reads head 0 of layer 1 only: the unused ordinal head (4) does not refuse it
    readout = train(TrainConfig(run_dir=str(tmp_path / "readout"), set_readout=1.0, set_hops="reader",
                                number_images=True, **base), numbering, log=lambda m: None)
    assert any(h.get("loss_set_readout", 0) > 0 for h in json.loads((readout / "state.json").read_text())["history"])
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "shallow"), set_referents=1.0, set_hops="shallow",
                             number_images=True, **base), numbering, log=lambda m: None)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["config"]["set_hops"] == "shallow" and state["config"]["number_images"]
    assert numbering.number_images  # the caller's processor is not switched by a run's setting
    plain = train(TrainConfig(run_dir=str(tmp_path / "plain"), number_images=False, **base), numbering,
                  log=lambda m: None)
    assert numbering.number_images
    assert any(h.get("loss_set_referent", 0) > 0 for h in state["history"])
    # resuming a run with another prompt form and hop placement: its checkpoint records what the resumed run used
    assert not load_checkpoint(str(plain))[1].number_images
    resumed = train(TrainConfig(run_dir=str(tmp_path / "plain"), number_images=True, set_referents=1.0,
                                set_hops="shallow", **{**base, "total_samples": 12}), numbering, log=lambda m: None)
    state = json.loads((resumed / "state.json").read_text())
    assert state["samples"] >= 12 and state["config"]["number_images"] and state["config"]["set_hops"] == "shallow"
    assert load_checkpoint(str(resumed))[1].number_images


def test_a_run_needs_room_only_for_the_hops_its_terms_use():
    """Each set term names the hops it trains or reads; the depth and head checks count those and no others."""
    deep, reader = SET_HOPS["deep"], SET_HOPS["reader"]
    assert hops_in_use(deep, False, False, False) == {}
    assert hops_in_use(deep, False, True, False) == {"mark": (SET_MARK_LAYER, SET_MARK_HEAD)}
    assert hops_in_use(reader, False, False, True) == {"patch": (reader.patch_layer, reader.patch_head)}
    assert hops_in_use(reader, True, True, True) == {
        "ordinal": (reader.word_layer, reader.word_head), "patch": (reader.patch_layer, reader.patch_head),
        "mark": (reader.mark_layer, reader.mark_head)}
    assert max(layer for layer, _ in hops_in_use(deep, False, True, False).values()) < deep.patch_layer
