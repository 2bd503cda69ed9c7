"""The set-consistency loss (training/target/set_consistency.py): a set's later images pulled towards their states
alone at the start of a prompt, checked against the model's states computed by hand."""

import random

import pytest
import torch

from specula.world import generate
from specula.training.target.batching import Encoder, collate
from specula.training.target.train import TrainConfig


def _states_at_images(model, enc, s):
    """The LM's hidden states (every layer) at the image tokens of ``s``, run alone: [layers, T, H]."""
    from specula.training.target.vision_heads import tower_features

    e = enc.encode(s)
    _, img = tower_features(model, e.pixel_values)
    emb = model.get_input_embeddings()(e.input_ids[None])
    mask = (e.input_ids[None] == model.config.image_token_id).unsqueeze(-1)
    emb = emb.masked_scatter(mask, img.reshape(-1, img.shape[-1]))
    hs = model.model.language_model(inputs_embeds=emb, output_hidden_states=True).hidden_states
    return torch.stack([h[0, mask[0, :, 0]] for h in hs[1:]])


def test_set_consistency_pulls_later_images_of_a_set_towards_their_states_alone(processor):
    from specula.world import image_sets as multi
    from specula.world.sample import Sample
    from specula.world.tokenizer import BOS, USER
    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.set_consistency import unit_rms
    from specula.training.target.train import forward_losses
    from specula.training.target.vision_heads import tower_features

    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    enc = Encoder(processor, sets=True)
    opening = torch.tensor(processor.tokenizer(BOS + USER, add_special_tokens=False).input_ids)
    cfg = TrainConfig(run_dir="x", set_consistency=1.0, freeze_vision=True)
    s = next(s for s in (multi.make_multi(random.Random(f"sets/{i}"), "multi_image", "qa", k=3) for i in range(40))
             if s.prompt.startswith("<image><image><image>"))
    e = enc.encode(s)
    assert e.lone_images.tolist() == [True, True, True]
    loss = forward_losses(model, collate([e], processor.tokenizer.pad_token_id), cfg, opening=opening)
    loss = loss["set_consistency"]
    with torch.no_grad():  # by hand: images 2 and 3 in the set against each alone opening a prompt
        got = _states_at_images(model, enc, s).view(-1, 3, 144, model.config.text_config.hidden_size)
        _, feats = tower_features(model, e.pixel_values)  # [3, T, H]
        d = []
        for j in (1, 2):
            alone = Sample(s.suite, s.kind, (s.images[j],), "<image>What is this?", "a", "a", None, (),
                           (s.patch_words[j],))
            ref = _states_at_images(model, enc, alone)  # [layers, T, H]
            d.append((unit_rms(got[:, j]) - unit_rms(ref)).pow(2).mean((0, 2)))  # [T]
        d, obj = torch.stack(d), feats[1:].abs().amax(-1) > 0  # [2, T]
        want = torch.stack([d[m].mean() for m in (obj, ~obj) if m.any()]).mean()
    assert float(loss.detach()) > 1e-3 and torch.allclose(loss.detach(), want, rtol=1e-4)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "language_model.layers.0." in n and p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    # object and background patches averaged apart: features zero outside each image's first 8 patches (a trained
    # projector gives background patches zero vectors; this random one gives none)
    from specula.training.target.set_consistency import set_consistency_loss

    batch = collate([e], processor.tokenizer.pad_token_id)
    with torch.no_grad():
        feats = feats.clone()
        feats[:, 8:] = 0
        mask = (batch.input_ids == model.config.image_token_id).unsqueeze(-1)
        emb = model.get_input_embeddings()(batch.input_ids).masked_scatter(mask, feats.reshape(-1, feats.shape[-1]))
        states = model.model.language_model(inputs_embeds=emb, output_hidden_states=True).hidden_states
        split = set_consistency_loss(model, batch, feats, states, opening)
        lone = model.model.language_model(inputs_embeds=torch.cat(
            [model.get_input_embeddings()(opening).expand(2, -1, -1), feats[1:]], 1), output_hidden_states=True)
        k, at = len(opening), mask[0, :, 0].nonzero().view(3, 144)[1:]  # [2, T] positions of images 2 and 3
        d = torch.stack([(unit_rms(h[0, at]) - unit_rms(r[:, k:])).pow(2).mean(-1)
                         for h, r in zip(states[1:], lone.hidden_states[1:])]).mean(0)  # [2, T]
    assert torch.allclose(split, (d[:, :8].mean() + d[:, 8:].mean()) / 2, rtol=1e-4)
    assert not torch.allclose(split, d.mean(), rtol=1e-2)  # not the plain mean over the patches
    # the first image opens the prompt: nothing to pull; a marker before it ("Image 1: ") makes it count
    one = Sample(s.suite, s.kind, s.images[:1], "<image>What colour is the object in the first image?", "a", "a",
                 None, (), s.patch_words[:1])
    b = collate([enc.encode(one)], processor.tokenizer.pad_token_id)
    assert float(forward_losses(model, b, cfg, opening=opening)["set_consistency"]) == 0.0
    marked = Sample(s.suite, s.kind, s.images[:1], "Image 1: <image>What colour is it?", "a", "a", None, (),
                    s.patch_words[:1])
    b = collate([enc.encode(marked)], processor.tokenizer.pad_token_id)
    assert float(forward_losses(model, b, cfg, opening=opening)["set_consistency"].detach()) > 1e-3
    clip = generate("video", "train", 0)  # a clip's frames are not flagged: read through each other
    assert not enc.encode(clip).lone_images.any()
    b = collate([enc.encode(clip)], processor.tokenizer.pad_token_id)
    assert float(forward_losses(model, b, cfg, opening=opening)["set_consistency"]) == 0.0
    # flags follow the features' order across rows, padding included: a one-image row in front (encoded with or
    # without sets) leaves the set row's loss as it was alone
    vqa = generate("vqa", "train", 0)
    for first in (enc.encode(vqa), Encoder(processor).encode(vqa)):
        mixed = collate([first, e], processor.tokenizer.pad_token_id)
        assert mixed.lone_images.tolist() == [False, True, True, True]
        both = forward_losses(model, mixed, cfg, opening=opening)["set_consistency"]
        assert torch.allclose(both.detach(), loss.detach(), rtol=1e-4)
    plain = collate([Encoder(processor).encode(s)], processor.tokenizer.pad_token_id)  # not encoded for sets
    assert plain.lone_images is None and "set_consistency" not in forward_losses(model, plain, cfg, opening=opening)
    with pytest.raises(ValueError, match="opening"):
        forward_losses(model, collate([e], processor.tokenizer.pad_token_id), cfg)
    with pytest.raises(ValueError, match="set_consistency"):
        TrainConfig(run_dir="x", set_consistency=-1.0)


def test_set_consistency_layers_pulls_only_the_first_layers_outputs(processor):
    """--set-consistency-layers N: the loss is the per-layer distance of the first N layers' outputs alone, and no
    layer above them gets a gradient from it (the layers that add each image's number stay free)."""
    from specula.world import image_sets as multi
    from specula.world.sample import Sample
    from specula.world.tokenizer import BOS, USER
    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.set_consistency import unit_rms
    from specula.training.target.train import forward_losses

    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny"), processor.tokenizer, seed=0)
    enc = Encoder(processor, sets=True)
    opening = torch.tensor(processor.tokenizer(BOS + USER, add_special_tokens=False).input_ids)
    s = next(s for s in (multi.make_multi(random.Random(f"sets/{i}"), "multi_image", "qa", k=3) for i in range(40))
             if s.prompt.startswith("<image><image><image>"))
    batch = collate([enc.encode(s)], processor.tokenizer.pad_token_id)
    n_layers = model.config.text_config.num_hidden_layers
    assert n_layers >= 2
    got = {}
    for layers in (0, 1, n_layers, n_layers + 5):
        cfg = TrainConfig(run_dir="x", set_consistency=1.0, set_consistency_layers=layers, freeze_vision=True)
        model.zero_grad()
        loss = forward_losses(model, batch, cfg, opening=opening)["set_consistency"]
        loss.backward()
        touched = {int(n.split("layers.")[1].split(".")[0]) for n, p in model.named_parameters()
                   if "language_model.layers." in n and p.grad is not None and float(p.grad.abs().sum()) > 0}
        got[layers] = (loss.detach(), touched)
    # one layer: only layer 0 learns from it; 0, N or more: every layer (the loss as before)
    assert got[1][1] == {0} and got[0][1] == set(range(n_layers))
    assert torch.allclose(got[n_layers][0], got[0][0]) and torch.allclose(got[n_layers + 5][0], got[0][0])
    with torch.no_grad():  # by hand: layer 0's outputs at images 2 and 3 against each image alone (no zero features
        # in this random projector, so every patch counts as an object patch: one mean)
        seq = _states_at_images(model, enc, s)[0].view(3, 144, -1)[1:]  # [2, T, H]
        alone = [_states_at_images(model, enc, Sample(s.suite, s.kind, (s.images[j],), "<image>What is this?", "a",
                                                      "a", None, (), (s.patch_words[j],)))[0] for j in (1, 2)]
        want = (unit_rms(seq) - unit_rms(torch.stack(alone))).pow(2).mean()
    assert float(got[1][0]) > 1e-3 and torch.allclose(got[1][0], want, rtol=1e-4)
    with pytest.raises(ValueError, match="set_consistency_layers"):
        TrainConfig(run_dir="x", set_consistency=1.0, set_consistency_layers=-1)
