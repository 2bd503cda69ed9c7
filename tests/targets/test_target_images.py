"""encode_images variants: shapes, and "projected" is exactly what the stock model feeds its language model."""

from __future__ import annotations

import pytest
import torch

from specula.targets import Accept, PrefillRequest

ATOL = 1e-5


def _images(kit):
    """Two images: LLaVA 2x [3, 28, 28]; Qwen 16x16 and 16x24 px (4 and 6 visual tokens)."""
    req = kit.request("img", [2, 2, 2], [0, 1], seed=51)
    return req, req.pixel_values, req.image_grid_thw


def _lm_inputs(kit, req):
    """inputs_embeds the stock model hands its language model for this prompt."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    handle = kit.model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        kit.recompute(req, req.input_ids.tolist())
    finally:
        handle.remove()
    return seen["embeds"][0]  # [L, H]


def test_projected_is_what_the_model_feeds_the_lm(kit):
    target = kit.target()
    req, pixels, grid = _images(kit)
    feats = target.encode_images(pixels, "projected", image_grid_thw=grid)
    embeds = _lm_inputs(kit, req)
    image_pos = req.input_ids == target.info.image_token_id
    torch.testing.assert_close(torch.cat(feats.per_image()), embeds[image_pos], atol=ATOL, rtol=0)
    if kit.name == "llava":
        assert feats.features.shape == (2, 4, 64) and feats.lengths == (4, 4) and feats.grid_hw == ((2, 2),) * 2
    else:
        assert feats.features.shape == (2, 6, 64) and feats.lengths == (4, 6) and feats.grid_hw == ((2, 2), (2, 3))
        assert feats.image_grid_thw.tolist() == grid.tolist()


def test_pre_projector_features_feed_the_projector(kit):
    target = kit.target()
    _, pixels, grid = _images(kit)
    pre = target.encode_images(pixels, "pre_projector", image_grid_thw=grid)
    proj = target.encode_images(pixels, "projected", image_grid_thw=grid)
    assert pre.lengths == proj.lengths
    if kit.name == "llava":
        assert pre.features.shape == (2, 4, target.info.vision_hidden_size)
        again = kit.model.model.multi_modal_projector(pre.features)  # [N_img, T, H]
        torch.testing.assert_close(again, proj.features, atol=ATOL, rtol=0)
    else:
        d = target.info.vision_hidden_size
        assert pre.features.shape == (2, 6, 4 * d)  # merge 2x2 patches per visual token
        for p, q in zip(pre.per_image(), proj.per_image()):
            again = kit.model.model.visual.merger(p.reshape(-1, d))  # [T_img, H]
            torch.testing.assert_close(again, q, atol=ATOL, rtol=0)


def test_pooled_features(kit):
    target = kit.target()
    _, pixels, grid = _images(kit)
    proj = target.encode_images(pixels, "projected", image_grid_thw=grid)
    one = target.encode_images(pixels, "pooled", grid=(1, 1), image_grid_thw=grid)
    assert one.variant == "pooled" and one.features.shape == (2, 1, 64) and one.lengths == (1, 1)
    for p, q in zip(one.per_image(), proj.per_image()):
        torch.testing.assert_close(p[0], q.mean(dim=0), atol=ATOL, rtol=0)
    two = target.encode_images(pixels, "pooled", grid=(2, 2), image_grid_thw=grid)
    assert two.features.shape == (2, 4, 64) and two.grid_hw == ((2, 2), (2, 2))
    with pytest.raises(ValueError, match="grid"):
        target.encode_images(pixels, "pooled", image_grid_thw=grid)
    with pytest.raises(ValueError, match="unknown variant"):
        target.encode_images(pixels, "cropped", image_grid_thw=grid)


def test_several_variants_come_from_one_tower_pass(kit):
    """encode_image_variants: each variant equals its own encode_images call, and the tower runs once for all."""
    target = kit.target()
    _, pixels, grid = _images(kit)
    want = [target.encode_images(pixels, v, grid=(1, 1), image_grid_thw=grid)
            for v in ("projected", "pre_projector", "pooled")]
    tower = kit.model.model.vision_tower if kit.name == "llava" else kit.model.model.visual
    calls = []
    handle = tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = target.encode_image_variants(pixels, ("projected", "pre_projector", "pooled"), grid=(1, 1),
                                           image_grid_thw=grid)
    finally:
        handle.remove()
    assert len(calls) == 1
    for g, w in zip(got, want, strict=True):
        assert (g.variant, g.lengths, g.grid_hw) == (w.variant, w.lengths, w.grid_hw)
        torch.testing.assert_close(g.features, w.features, atol=0, rtol=0)
    for bad, match in ((("projected", "cropped"), "unknown variant"), ((), "non-empty"), ("projected", "non-empty"),
                       (("pooled",), "grid")):
        with pytest.raises(ValueError, match=match):
            target.encode_image_variants(pixels, bad, image_grid_thw=grid)


def test_prefill_with_precomputed_visual_equals_pixels(kit):
    """A separate vision stage can hand over projected features instead of pixels."""
    target = kit.target()
    req, pixels, grid = _images(kit)
    feats = target.encode_images(pixels, "projected", image_grid_thw=grid)
    from_pixels = target.prefill([req]).logits
    reqs = [PrefillRequest("f", req.input_ids, visual=feats)]
    if kit.name == "llava":  # equal-size images may also come as a plain [N_img, T_img, H] tensor
        reqs.append(PrefillRequest("t", req.input_ids, visual=feats.features))
    out = target.prefill(reqs).logits
    for row in range(len(reqs)):
        torch.testing.assert_close(out[row], from_pixels[0], atol=1e-5, rtol=0)


def test_images_change_the_output(kit):
    """The tiny random target really looks at the image (otherwise image tests would prove little)."""
    target = kit.target()
    req, pixels, grid = _images(kit)
    other = PrefillRequest("o", req.input_ids, pixels.flip(0) * -1.0, grid)
    a, b = target.prefill([req, other]).logits
    assert (a - b).abs().max() > 1e-3
    target.commit([Accept("img", (), 5), Accept("o", (), 5)])
