"""Set isolation: a set's later images' object patches are kept off the earlier images' tokens (spans, the loss
against a hand computation, wiring)."""

import json
import random

import pytest
import torch

from loss_kit import assert_own_term_reaching_layer0

from specula.targets.processor import load_processor
from specula.world import image_sets as multi
from specula.world.scene import make_dialogue
from specula.training.target.batching import Encoder, collate
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.referents import eager_attention
from specula.training.target.set_isolation import IsolationSpan, set_isolation_loss, set_isolation_spans
from specula.training.target.set_referents import object_patches
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, train
from specula.training.target.vision_heads import tower_features

T = 144  # image tokens per image


@pytest.fixture(scope="module")
def proc():
    return load_processor(TOKENIZER_DIR)


def _sets(n: int):
    rng = random.Random("set-isolation")
    return [multi.make_multi(rng, "multi_image", "qa") for _ in range(n)]


def test_each_later_image_gets_its_object_patches_and_the_images_before_it(proc):
    enc = Encoder(proc, set_isolation=True)
    seen = 0
    for s in _sets(6):
        e = enc.encode(s)
        image_pos = (e.input_ids == enc.image_id).nonzero()[:, 0].tolist()
        spans = [t for t in e.referents if isinstance(t, IsolationSpan)]
        want = [n for n in range(1, len(s.images)) if object_patches(s.patch_words[n])]
        assert len(spans) == len(want)
        for n, span in zip(want, spans):
            assert span.patches == tuple(image_pos[n * T + t] for t in object_patches(s.patch_words[n]))
            assert span.others == tuple(image_pos[:n * T])
            assert max(span.others) < min(span.patches)
            seen += 1
    assert seen >= 6
    rng = random.Random("set-isolation/none")
    assert enc.encode(multi.make_video(rng, "video", "qa")).referents == ()  # a clip's frames read each other
    assert set_isolation_spans(make_dialogue(rng, "vqa_dialogue", "vqa"), torch.zeros(4, dtype=torch.long), 3) == ()


def test_the_loss_is_minus_log_of_the_mass_left_off_the_earlier_images(proc):
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), proc.tokenizer, seed=0)
    lm = model.model.language_model
    enc = Encoder(proc, set_isolation=True)
    batch = collate([enc.encode(s) for s in _sets(3)], proc.tokenizer.pad_token_id)
    with torch.no_grad(), eager_attention(lm):
        embeds = model.get_input_embeddings()(batch.input_ids)  # [B, L, H]
        img = tower_features(model, batch.pixel_values)[1].reshape(-1, embeds.shape[-1])
        embeds = embeds.masked_scatter((batch.input_ids == enc.image_id).unsqueeze(-1), img)
        att = lm(inputs_embeds=embeds, attention_mask=batch.attention_mask, output_attentions=True).attentions
    got = set_isolation_loss(att, batch.referents)
    terms = []
    for b, row in enumerate(batch.referents):
        for span in row:
            for a in att:  # each (image, layer) weighs the same, whatever the object's size
                terms.append(torch.stack([-torch.log(1 - a[b, h, p, list(span.others)].sum())
                                          for h in range(a.shape[1]) for p in span.patches]).mean())
    assert terms and torch.allclose(got, torch.stack(terms).mean(), rtol=1e-4)
    assert 0 < float(got) < 10
    assert set_isolation_loss(att, [(), (), ()]) is None


def test_a_patch_saturated_on_the_earlier_images_still_gets_the_full_gradient():
    """A patch that puts all but ~4.6e-12 of its mass on an earlier image's token: the loss is -log of what is left
    and the gradient on its own token's score is about -1; taking 1 - mass in fp32 (0 there) behind a clamp would
    give no gradient at all, so a head that blends a set's images completely could not be pulled off them."""
    import math

    L = 5
    span = IsolationSpan(patches=(3,), others=(0, 1))
    scores = torch.zeros(1, 1, L, L)
    scores[0, 0, 3, :2] = 25.0  # keys 0 and 1 (the earlier image) take all but e^-25 / 2 of each of keys 2 and 3
    scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf")).requires_grad_(True)
    loss = set_isolation_loss([scores.softmax(-1)], [[span]])
    rest = 2 / (2 * math.exp(25) + 2)
    assert loss.item() == pytest.approx(-math.log(rest), rel=1e-4)
    loss.backward()
    assert scores.grad[0, 0, 3, 3].item() == pytest.approx(-0.5, abs=1e-3)  # each of the two own keys: -1/2
    assert scores.grad[0, 0, 3, 0].item() == pytest.approx(0.5, abs=1e-3)


def test_the_term_is_its_own_loss_and_trains_the_first_layer(proc):
    assert_own_term_reaching_layer0(proc.tokenizer, [Encoder(proc, set_isolation=True).encode(s) for s in _sets(2)],
                                    "set_isolation")


def test_a_run_trains_both_set_terms(tmp_path, proc):
    """train() wires --set-readout (its token ids, the set targets it reads) and --set-isolation into the loss."""
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), arch="tiny", total_samples=8, pool=8, token_budget=4096,
                      warmup_samples=2, eval_n=2, eval_every_s=0.0, ckpt_every_s=1e9, threads=1, vision_images=8,
                      mix="scan_multi", set_readout=1.0, set_isolation=1.0, set_hops="shallow", number_images=True)
    ckpt = train(cfg, proc, log=lambda m: None)
    history = json.loads((ckpt / "state.json").read_text())["history"]
    assert any(h.get("loss_set_readout", 0) > 0 for h in history)
    assert any(h.get("loss_set_isolation", 0) > 0 for h in history)
    assert not any("loss_set_referent" in h for h in history)  # the readout builds the set targets, not their loss
