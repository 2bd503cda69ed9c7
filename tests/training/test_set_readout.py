"""Set readout: the set patch-hop head's own output, read through the final norm and LM head, predicts a set's
answer (the term's value against a hand computation from the attention weights, where its gradient goes, wiring)."""

import random

import pytest
import torch
import torch.nn.functional as F

from loss_kit import head_readout_by_hand, image_embeds

from specula.targets.processor import load_processor
from specula.world import image_sets as multi
from specula.world.vocab import COLOUR_NAMES, SHAPES
from specula.training.target.batching import Encoder, collate
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.referents import eager_attention
from specula.training.target.set_count import COUNT_LAYER, SUMMARY_LAYER
from specula.training.target.set_readout import (count_readout_loss, head_inputs, readout_token_ids, set_readout_loss,
                                     summary_readout_loss)
from specula.training.target.set_referents import SET_HOPS
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, forward_losses


@pytest.fixture(scope="module")
def setup():
    proc = load_processor(TOKENIZER_DIR)
    proc.number_images = True
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), proc.tokenizer, seed=0)
    enc = Encoder(proc, set_referents=True)
    rng = random.Random("set-readout")
    samples = [multi.make_multi(rng, "multi_image", "qa") for _ in range(6)]
    samples += [multi.make_multi(rng, "multi_image", "caption", scan=True) for _ in range(2)]
    batch = collate([enc.encode(s) for s in samples], proc.tokenizer.pad_token_id)
    return model, enc, batch


def test_the_readout_ids_are_the_colour_and_shape_words(setup):
    _, enc, _ = setup
    ids = readout_token_ids(enc.word_id)
    words = {enc.processor.tokenizer.decode([i]).strip() for i in ids.tolist()}
    assert words == set(COLOUR_NAMES) | set(SHAPES)


def test_the_term_is_the_hop_heads_direct_logits_computedhead_readout_by_hand(setup):
    model, enc, batch = setup
    lm = model.model.language_model
    hops = SET_HOPS["deep"]
    keep = readout_token_ids(enc.word_id)
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [hops.patch_layer]) as got:
        out = lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask, output_attentions=True,
                 output_hidden_states=True)
        term = set_readout_loss(lm, model.lm_head, got, batch.referents, batch.labels, keep)
    assert term is not None and float(term) > 0
    # by hand: the head's weights at the query times its values, through that head's o_proj columns
    terms, kept = [], 0
    for b, row in enumerate(batch.referents):
        for t in row:
            if t.group != "set" or int(batch.labels[b, t.query + 1]) not in set(keep.tolist()):
                continue
            logits = head_readout_by_hand(model, out, t.patch_layer, t.head, b, t.query)
            terms.append(F.cross_entropy(logits[None], batch.labels[b, t.query + 1][None]))
            kept += 1
    assert kept >= 8  # which answers and the caption lines' colour / shape words
    assert torch.allclose(term, torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)


def _count_batch(enc, seed: str):
    """Three image-set dialogues encoded with their count targets, and their batch."""
    counts = Encoder(enc.processor, set_count=True)
    rng = random.Random(seed)
    samples = [multi.make_multi_dialogue(rng, "multi_dialogue", "qa") for _ in range(3)]
    return samples, collate([counts.encode(s) for s in samples], enc.processor.tokenizer.pad_token_id)


def test_the_summary_readout_asks_each_summary_head_for_its_images_shapes(setup):
    model, enc, _ = setup
    samples, batch = _count_batch(enc, "set-readout/summary")
    lm = model.model.language_model
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [SUMMARY_LAYER]) as got:
        out = lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask, output_attentions=True,
                 output_hidden_states=True)
        term = summary_readout_loss(lm, model.lm_head, got, batch.referents)
    terms = []
    for b, row in enumerate(batch.referents):
        for t in row:
            if t.group == "set_count" and t.says and not t.spread:
                logp = head_readout_by_hand(model, out, t.patch_layer, t.head, b, t.query).log_softmax(-1)
                terms.append(-logp[list(t.says)].mean())
    assert len(terms) >= 6 and any(len(t.says) == 2 for row in batch.referents for t in row)
    assert torch.allclose(term, torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)
    assert summary_readout_loss(lm, model.lm_head, got, [[]] * len(samples)) is None


def test_the_number_readout_asks_each_count_head_for_its_answer(setup):
    model, enc, _ = setup
    _, batch = _count_batch(enc, "set-readout/number")
    lm = model.model.language_model
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [COUNT_LAYER]) as got:
        out = lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask, output_attentions=True,
                 output_hidden_states=True)
        term = count_readout_loss(lm, model.lm_head, got, batch.referents)
        # the summaries' readout reads layer 0: with only layer 1 captured it finds nothing to read
        assert summary_readout_loss(lm, model.lm_head, got, batch.referents) is None
    terms = []
    for b, row in enumerate(batch.referents):
        for t in row:
            if t.group == "set_count" and t.spread:
                assert len(t.says) == 1 and int(batch.labels[b, t.query + 1]) == t.says[0]  # the answer's number
                logp = head_readout_by_hand(model, out, t.patch_layer, t.head, b, t.query).log_softmax(-1)
                terms.append(-logp[t.says[0]])
    assert len(terms) >= 3
    assert torch.allclose(term, torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)
    # both readouts on, both layers captured: each term reads its own targets only
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [SUMMARY_LAYER]) as alone:
        lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask)
        summaries_alone = summary_readout_loss(lm, model.lm_head, alone, batch.referents)
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [SUMMARY_LAYER, COUNT_LAYER]) as both:
        lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask)
        assert torch.allclose(summary_readout_loss(lm, model.lm_head, both, batch.referents), summaries_alone)
        assert torch.allclose(count_readout_loss(lm, model.lm_head, both, batch.referents), term)


def test_the_term_trains_the_hop_head_and_not_the_lm_head(setup):
    model, enc, batch = setup
    model.zero_grad(set_to_none=True)
    cfg = TrainConfig(run_dir="x", set_readout=1.0, freeze_vision=True)
    losses = forward_losses(model, batch, cfg, readout_ids=readout_token_ids(enc.word_id))
    assert "set_referent" not in losses  # the readout alone turns no attention loss on
    losses["set_readout"].backward()
    layer = SET_HOPS["deep"].patch_layer
    grads = dict(model.named_parameters())
    o_proj = grads[f"model.language_model.layers.{layer}.self_attn.o_proj.weight"].grad
    d = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    assert float(o_proj[:, :d].abs().sum()) > 0 and float(o_proj[:, d:].abs().sum()) == 0  # head 0's columns only
    assert grads[f"model.language_model.layers.{layer}.self_attn.v_proj.weight"].grad is not None
    assert grads["model.language_model.layers.0.mlp.down_proj.weight"].grad is not None  # the layers below
    unseen = sorted(set(range(model.lm_head.weight.shape[0])) - set(batch.input_ids.flatten().tolist()))
    assert float(model.lm_head.weight.grad[unseen].abs().sum()) == 0  # tied: only the input embeddings' rows move
    assert grads["model.language_model.norm.weight"].grad is None
    assert f"model.language_model.layers.{layer + 1}.self_attn.o_proj.weight" not in \
        {n for n, p in model.named_parameters() if p.grad is not None and float(p.grad.abs().sum()) > 0}
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="readout_ids"):
        forward_losses(model, batch, cfg)
    assert "set_readout" not in forward_losses(model, batch, TrainConfig(run_dir="x", freeze_vision=True))
    with pytest.raises(ValueError, match="set_readout"):
        TrainConfig(run_dir="x", set_readout=-1.0)
