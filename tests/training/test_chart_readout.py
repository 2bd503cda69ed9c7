"""Chart readout: the chart lookup head's own output, read through the final norm and LM head, predicts a value
question's answer (the term's value against a hand computation from the attention weights, which targets it reads,
where its gradient goes, the flag and its refusals)."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from loss_kit import head_readout_by_hand, image_embeds

from specula.world import charts
from specula.training.target.batching import Encoder, collate
from specula.training.target.cli import parse_config
from specula.training.target.chart_readout import READ_LAYER, VALUES, chart_readout_loss, value_token_ids
from specula.training.target.chart_referents import NUMBER_LAYER
from specula.training.target.referents import eager_attention
from specula.training.target.set_readout import head_inputs
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, forward_losses, train


def _dialogues(n: int = 2):
    out = []
    for kind in ("chart_dialogue/bar", "chart_dialogue/line", "chart_dialogue/pie"):
        rng = random.Random(f"chart-readout/{kind}")
        found = (s for s in (charts.make_dialogue(rng, "chart", "qa") for _ in range(200)) if s.kind == kind)
        out += [next(found) for _ in range(n)]
    return out


@pytest.fixture(scope="module")
def setup(processor):
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer, seed=0)
    enc = Encoder(processor, chart_referents=True, chart_words="whole")
    batch = collate([enc.encode(s) for s in _dialogues()], processor.tokenizer.pad_token_id)
    return model, enc, batch


def test_the_value_ids_are_the_digits_a_chart_draws(processor, setup):
    _, enc, _ = setup
    ids = value_token_ids(enc.word_id)
    assert sorted(processor.tokenizer.decode([i]).strip() for i in ids.tolist()) == list(VALUES)


def test_the_term_is_the_lookup_heads_direct_logits_at_value_answers_computed_by_hand(processor, setup):
    model, enc, batch = setup
    lm = model.model.language_model
    keep = value_token_ids(enc.word_id)
    with torch.no_grad(), eager_attention(lm), head_inputs(lm, [READ_LAYER]) as got:
        out = lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask,
                 output_attentions=True, output_hidden_states=True)
        term = chart_readout_loss(lm, model.lm_head, got, batch.referents, batch.labels, keep)
    assert term is not None and float(term) > 0
    terms, skipped = [], set()
    for b, row in enumerate(batch.referents):
        for t in row:
            assert t.group == "chart" and t.patch_layer == READ_LAYER  # reading words: no number hop
            answer = batch.labels[b, t.query + 1]
            word = processor.tokenizer.decode([int(answer)]).strip()
            if word not in VALUES:
                skipped.add(word)
                continue
            logits = head_readout_by_hand(model, out, t.patch_layer, t.head, b, t.query)
            terms.append(F.cross_entropy(logits[None], answer[None]))
    assert len(terms) >= 8  # the bar and point values
    assert skipped & set(charts.CHART_COLOURS) and skipped & {"two", "three", "four", "five"}  # superlatives, counts
    assert torch.allclose(term, torch.stack(terms).mean(), rtol=1e-4, atol=1e-5)
    assert chart_readout_loss(lm, model.lm_head, got, [[]] * len(batch.referents), batch.labels, keep) is None
    with head_inputs(lm, [READ_LAYER + 1]) as elsewhere:  # the lookup head's layer not captured: nothing to read
        lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask)
        assert chart_readout_loss(lm, model.lm_head, elsewhere, batch.referents, batch.labels, keep) is None


def test_the_number_hop_of_a_run_without_reading_words_is_not_read(processor, setup):
    model, words, _ = setup
    keep = value_token_ids(words.word_id)
    enc = Encoder(processor, chart_referents=True)
    batch = collate([enc.encode(s) for s in _dialogues()], processor.tokenizer.pad_token_id)
    lookups = [t for row in batch.referents for t in row if t.patch_layer == READ_LAYER]
    assert lookups and any(t.patch_layer == NUMBER_LAYER for row in batch.referents for t in row)
    lm = model.model.language_model
    with torch.no_grad(), head_inputs(lm, [READ_LAYER, NUMBER_LAYER]) as both:
        lm(inputs_embeds=image_embeds(model, batch), attention_mask=batch.attention_mask)
        term = chart_readout_loss(lm, model.lm_head, both, batch.referents, batch.labels, keep)
        lookup_only = [[t for t in row if t.patch_layer == READ_LAYER] for row in batch.referents]
        assert torch.allclose(term, chart_readout_loss(lm, model.lm_head, both, lookup_only, batch.labels, keep))


def test_the_term_trains_the_lookup_head_and_not_the_lm_head(setup):
    model, enc, batch = setup
    model.zero_grad(set_to_none=True)
    cfg = TrainConfig(run_dir="x", chart_referents=1.0, chart_readout=1.0, freeze_vision=True)
    losses = forward_losses(model, batch, cfg, value_ids=value_token_ids(enc.word_id))
    assert {"chart_readout", "chart_referent"} <= set(losses)
    losses["chart_readout"].backward()
    grads = dict(model.named_parameters())
    o_proj = grads[f"model.language_model.layers.{READ_LAYER}.self_attn.o_proj.weight"].grad
    d = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
    assert float(o_proj[:, :d].abs().sum()) > 0 and float(o_proj[:, d:].abs().sum()) == 0  # head 0's columns only
    assert grads["model.language_model.layers.0.mlp.down_proj.weight"].grad is not None  # the layers below
    assert grads["model.language_model.norm.weight"].grad is None
    unseen = sorted(set(range(model.lm_head.weight.shape[0])) - set(batch.input_ids.flatten().tolist()))
    assert float(model.lm_head.weight.grad[unseen].abs().sum()) == 0  # tied: only the input embeddings' rows move
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="value_ids"):
        forward_losses(model, batch, cfg)
    assert "chart_readout" not in forward_losses(model, batch, TrainConfig(run_dir="x", chart_referents=1.0,
                                                                           freeze_vision=True))


def test_the_flag_reaches_the_config_is_refused_alone_and_a_run_trains_the_term(processor, tmp_path):
    cfg = parse_config(["--chart-referents", "3", "--chart-readout", "0.5"])
    assert cfg.chart_readout == 0.5
    assert parse_config([]).chart_readout == 0.0
    with pytest.raises(ValueError, match="chart_readout must be >= 0"):
        TrainConfig(chart_referents=1.0, chart_readout=-1.0)
    with pytest.raises(ValueError, match="needs chart_referents"):
        TrainConfig(chart_readout=1.0)
    ckpt = train(TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny_deep", chart_referents=1.0, chart_readout=1.0,
                             chart_words="whole", total_samples=48, pool=16, token_budget=4096, warmup_samples=2,
                             eval_n=2, eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=8,
                             mix="scan_suites_charts"), processor, log=lambda *a: None)
    history = json.loads((ckpt / "state.json").read_text())["history"]
    assert any(h.get("loss_chart_readout", 0) > 0 for h in history)
