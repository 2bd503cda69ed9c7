"""The image-reading drafters on Qwen2.5-VL prompts whose images have different token counts (the tiny stock
checkpoint of ``tests/stock_checkpoints.py``): the engine hands them the target's features padded to the longest
image, [N_img, T_max, D]; each drafter reads every image's own count from the prompt ids (``drafters/image_runs.py``).

``msd``, ``massv`` (and an ``ensemble`` of all four members: multimodal, text, caption, pooled on non-square images)
and ``flash`` (m latent tokens below and above an image's count), freshly initialised and sized from the target by
the code their trainers use, draft for (a) two images of different sizes, (b) one image of a size the others do not
have, (c) a text-only prompt: greedy output equals plain decoding and every request really drafted. The padding
never reaches a draft (garbage there changes nothing), an image count that does not fit the features is refused,
named; and the helper's rules on both layouts (LLaVA's fixed count with touching runs, Qwen's one image per run).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from PIL import Image

from specula.drafters import DraftContext, create
from specula.drafters.flash_head import FlashConfig, FlashHead, draft_inputs, layout
from specula.drafters.image_runs import feature_lengths, image_lengths, image_runs, image_starts, unpad
from specula.drafters.msd_head import MsdConfig, MsdHead
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import encode_messages
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.training.drafters import massv as tm

# (width, height) in pixels: Qwen2.5-VL's 28-pixel merge units -> (W/28) * (H/28) image tokens
SIZES = {"a": [(28 * 4, 28 * 2), (28 * 2, 28 * 6)], "b": [(28 * 6, 28 * 4)], "c": []}  # 8 + 12; 24; none


def _prompt(processor, sizes):
    images = [Image.new("RGB", s, (40 * i + 100, 30, 200 - 50 * i)) for i, s in enumerate(sizes)]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe the colours."}]
    return encode_messages(processor, [{"role": "user", "content": parts}], images)


@pytest.fixture(scope="module")
def qwen(qwen25vl_dir):
    torch.set_num_threads(1)
    target, processor = load_target(qwen25vl_dir), load_processor(qwen25vl_dir)
    prompts = {k: _prompt(processor, s) for k, s in SIZES.items()}
    params = SamplingParams(max_tokens=10)
    reqs = [p.request(k, params) for k, p in prompts.items()]
    plain = SpecEngine(target, None).generate(reqs)
    return {"dir": qwen25vl_dir, "target": target, "processor": processor, "prompts": prompts, "reqs": reqs,
            "plain": plain}


def _counts(q, key) -> list[int]:
    return [n for _, n in image_runs(q["prompts"][key].input_ids, q["target"].info.image_token_id)]


def _assert_drafts_losslessly(q, drafter, gamma: int = 3) -> None:
    """Greedy output == plain decoding for every prompt, one request at a time and all three batched; every request
    drafted."""
    assert _counts(q, "a") == [8, 12] and _counts(q, "b") == [24] and _counts(q, "c") == []
    eng = SpecEngine(q["target"], drafter, gamma=gamma)
    for batch in ([[r] for r in q["reqs"]], [q["reqs"]]):
        for reqs in batch:
            got = eng.generate(reqs)
            for r in reqs:
                assert got[r.request_id].tokens == q["plain"][r.request_id].tokens, r.request_id
                assert got[r.request_id].metrics.draft_tokens > 0, r.request_id


def _msd_head(target) -> MsdHead:
    torch.manual_seed(0)
    return MsdHead(MsdConfig.from_target(target)).eval()  # the trainers' sizing (eagle.new_head)


def _flash_head(target, m: int) -> FlashHead:
    torch.manual_seed(0)
    cfg = replace(FlashConfig.from_target(target), visual_tokens=m, tokens_per_pass=2)
    assert cfg.image_tokens is None  # Qwen2.5-VL: no fixed count per image
    head = FlashHead(cfg).eval()
    with torch.no_grad():
        for lin in head.offsets:
            lin.weight.normal_(0, 0.05)
    return head


def _massv_model(q):
    cfg = tm.MassvTrainConfig(run_dir="unused", target=str(q["dir"]), init_lm=None, arch="tiny", device="cpu",
                              caption_max_tokens=4)
    return tm.build(cfg, q["target"], q["processor"].tokenizer, q["processor"]).eval()


# ---------------------------------------------------------------------------------------------- lossless drafting


def test_msd_drafts_for_images_of_any_size(qwen):
    d = create({"kind": "msd", "head": _msd_head(qwen["target"])}, target=qwen["target"])
    assert d.decoupled and d.spec.needs == {"hidden", "visual"}
    _assert_drafts_losslessly(qwen, d)


def test_massv_and_a_four_member_ensemble_draft_for_images_of_any_size(qwen):
    model = _massv_model(qwen)
    assert model.config.caption_prompt  # Qwen's template spells an image as one pad token: caption mode is on
    d = create({"kind": "massv", "model": model}, target=qwen["target"], tokenizer=qwen["processor"].tokenizer)
    assert d.spec.needs == {"pre_projector"}
    _assert_drafts_losslessly(qwen, d)
    ens = create({"kind": "ensemble", "model": model, "members": ["multimodal", "text", "caption",
                                                                  {"kind": "pooled", "grid": 2}],
                  "caption_max_tokens": 3, "join": "at_once"}, target=qwen["target"])
    _assert_drafts_losslessly(qwen, ens)


@pytest.mark.parametrize("m", [10, 64])
def test_flash_drafts_for_images_of_any_size(qwen, m):
    """m = 10: the 12- and 24-token images compress, the 8-token one keeps 8; m = 64 (the default): none compress."""
    d = create({"kind": "flash", "head": _flash_head(qwen["target"], m)}, target=qwen["target"])
    _assert_drafts_losslessly(qwen, d, gamma=4)


def test_massv_trained_through_the_cli_drafts_for_image_sizes_it_never_saw(qwen, conversations_file, tmp_path):
    """The brief's reproduction: a tiny ``specula train massv --target DIR --data FILE`` export (the file's pictures
    all become 4-token images) drafts for the two-image prompt of 8 + 12 tokens that it refused before."""
    from specula.cli import main

    out = tmp_path / "out"
    assert main(["train", "massv", "--target", str(qwen["dir"]), "--data", str(conversations_file), "--run-dir",
                 str(tmp_path / "run"), "--out", str(out), "--export", "--arch", "tiny", "--pretrain-samples", "4",
                 "--samples", "4", "--data-samples", "4", "--max-new-tokens", "6", "--threads", "1"]) == 0
    d = create({"kind": "massv", "path": str(out)}, target=qwen["target"], tokenizer=qwen["processor"].tokenizer)
    _assert_drafts_losslessly(qwen, d)


def test_aasd_drafts_for_images_of_any_size(qwen):
    """AASD on a target without a fixed image size: each image's cached K/V average-pooled to min(k, T_img)
    entries (8, 12 and 24 tokens here, k 10), no image refused."""
    from specula.drafters.aasd_head import AasdConfig, AasdHead, context_kv

    torch.manual_seed(0)
    cfg = replace(AasdConfig.from_target(qwen["target"]), kv_tokens=10)
    assert cfg.image_tokens is None
    head = AasdHead(cfg).init_from_target(qwen["target"]).eval()
    d = create({"kind": "aasd", "head": head}, target=qwen["target"])
    _assert_drafts_losslessly(qwen, d)
    ids = qwen["prompts"]["a"].input_ids
    k = torch.randn(2, len(ids), 4)  # [H_kv, L, D]
    kc, vc, src = context_kv(head, ids, k, k.clone())
    assert kc.shape[1] == len(ids) - 20 + 8 + 10  # the 8-token image stays 8 entries, the 12-token one becomes 10
    assert torch.equal(src, torch.sort(src).values)


@pytest.mark.parametrize("kind", ["flash", "msd", "aasd"])
def test_heads_trained_on_the_file_draft_for_image_sizes_they_never_saw(qwen, kind, conversations_file, tmp_path):
    """A few steps of ``specula train flash|msd|aasd`` on the Qwen target and the conversation file (its pictures
    all become 4-token images), exported and loaded by directory: the head drafts for images of 8, 12 and 24
    tokens."""
    from specula.training.drafters import aasd as ta
    from specula.training.drafters import flash as tf
    from specula.training.drafters import msd as tmsd

    small = dict(run_dir=str(tmp_path / "run"), target=str(qwen["dir"]), data_file=str(conversations_file),
                 data_samples=8, eval_samples=1, total_samples=8, pool=8, token_budget=2048, eval_engine=1,
                 max_new_tokens=6, warmup_samples=2)
    if kind == "flash":
        out = tf.export_flash(tf.train(tf.FlashTrainConfig(**small, visual_tokens=10, tokens_per_pass=2),
                                       log=lambda *_: None), tmp_path / "out")
    elif kind == "aasd":
        out = ta.export_aasd(ta.train(ta.AasdTrainConfig(**small, kv_tokens=6, train_depth=2), log=lambda *_: None),
                             tmp_path / "out")
    else:
        out = tmsd.export_msd(tmsd.train(tmsd.MsdTrainConfig(**small, text_samples=2), log=lambda *_: None),
                              tmp_path / "out")
    d = create({"kind": kind, "path": str(out)}, target=qwen["target"])
    assert d.head.config.image_token_id == qwen["target"].info.image_token_id
    if kind == "flash":
        assert d.head.config.image_tokens is None and d.head.config.visual_tokens == 10
    _assert_drafts_losslessly(qwen, d, gamma=4)


# ---------------------------------------------------------------------------------------------- what the drafters read


def _context(q, key, variant: str, pad: float = 0.0) -> DraftContext:
    """The DraftContext of prompt ``key`` as the engine makes it: features padded to the longest image, the padding
    filled with ``pad``."""
    target, p = q["target"], q["prompts"][key]
    out = target.prefill([p.prefill(key)])
    vf = target.encode_images(p.pixel_values, variant, image_grid_thw=p.image_grid_thw)
    f = vf.features.clone()  # [N_img, T_max, D]
    for j, t in enumerate(vf.lengths):
        f[j, t:] = pad
    target.release([key])
    n = len(p.input_ids)
    if variant == "pre_projector":
        return DraftContext(key, p.input_ids, 7, hidden=out.features.hidden[0, :n], extra={"pre_projector": f})
    return DraftContext(key, p.input_ids, 7, hidden=out.features.hidden[0, :n], visual=f)


def _proposal(drafter, ctx: DraftContext):
    drafter.begin([ctx])
    prop = drafter.propose([ctx.request_id], gamma=4)
    drafter.release([ctx.request_id])
    return prop.tokens[0, : prop.counts[0]].tolist(), prop.q


def test_the_padding_never_reaches_a_draft_and_a_misfit_is_refused(qwen):
    target = qwen["target"]
    model = _massv_model(qwen)
    drafters = {"projected": [create({"kind": "msd", "head": _msd_head(target)}, target=target),
                              create({"kind": "flash", "head": _flash_head(target, 10)}, target=target)],
                "pre_projector": [create({"kind": "ensemble", "model": model, "caption_max_tokens": 3,
                                          "members": ["multimodal", "caption", "pooled"], "join": "at_once"},
                                         target=target)]}
    for variant, ds in drafters.items():
        zero, junk = _context(qwen, "a", variant), _context(qwen, "a", variant, pad=1e4)
        for d in ds:
            assert _proposal(d, zero)[0] == _proposal(d, junk)[0]
            torch.testing.assert_close(_proposal(d, zero)[1], _proposal(d, junk)[1])
            f = zero.visual if variant == "projected" else zero.extra["pre_projector"]
            for bad in (f[:1], f[:, :10]):  # one image's features for two; the 12-token image cut to 10
                ctx = replace(zero, visual=bad) if variant == "projected" else replace(zero, extra={variant: bad})
                with pytest.raises(ValueError, match=r"8, 12"):
                    d.begin([ctx])
    # what msd reads at the image positions: each image's own rows, in prompt order
    d = drafters["projected"][0]
    ctx = _context(qwen, "a", "projected")
    vf = target.encode_images(qwen["prompts"]["a"].pixel_values, "projected",
                              image_grid_thw=qwen["prompts"]["a"].image_grid_thw)
    got = d._prompt_inputs([ctx], len(ctx.prompt_ids))
    torch.testing.assert_close(got["visual"][0][got["visual_mask"][0]], torch.cat(vf.per_image()))


def test_flash_compresses_each_image_on_its_own():
    head = FlashHead(FlashConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=4, vocab_size=32, image_token_id=9, visual_tokens=3)).eval()
    a, b = torch.randn(2, 8), torch.randn(5, 8)
    comp = head.compress_images([a, b])  # [2 + 3, H]: the 2-token image keeps 2, the 5-token one is cut to 3
    torch.testing.assert_close(comp[:2], head._attend(head.queries[:2], a[None])[0])
    torch.testing.assert_close(comp[2:], head.compress(b[None])[0])
    same = [torch.randn(4, 8), torch.randn(4, 8)]  # one size >= m: the batched compression, bit for bit
    assert torch.equal(head.compress_images(same), head.compress(torch.stack(same)).reshape(-1, 8))
    ids = torch.tensor([5, 1, 9, 9, 2, 1, 9, 9, 9, 9, 9, 2, 6])  # Qwen: <start> 2 pads <end>, <start> 5 pads <end>
    lay = layout(ids, 9, None, 3)
    assert lay.lengths == (2, 5) and lay.latents == (2, 3) and lay.length == 13 - 7 + 5
    assert lay.text_pos.tolist() == [0, 1, 4, 5, 11, 12] and lay.text_slot.tolist() == [0, 1, 4, 5, 9, 10]
    assert lay.image_slot.tolist() == [[2, 3, -1], [6, 7, 8]] and lay.slots.tolist() == [2, 3, 6, 7, 8]
    x = draft_inputs(head, torch.randn(13, 8), comp, lay)
    torch.testing.assert_close(x[lay.slots], comp)
    with pytest.raises(ValueError, match="whole number"):
        layout(ids, 9, 3, 2)  # a fixed 3-token image (LLaVA) cannot read a 2-token run


# ---------------------------------------------------------------------------------------------- the helper


def test_image_runs_on_both_layouts():
    qwen = torch.tensor([1, 9, 9, 2, 1, 9, 9, 9, 2, 5])
    assert image_runs(qwen, 9) == [(1, 2), (5, 3)] and image_lengths(qwen, 9) == (2, 3)
    assert image_starts(qwen, 9, (2, 3)).tolist() == [1, 5]
    llava = [5, 9, 9, 9, 9, 6, 9, 9, 7]  # images of 2 tokens, two touching, one later
    assert image_runs(llava, 9) == [(1, 4), (6, 2)] and image_lengths(llava, 9, 2) == (2, 2, 2)
    assert image_starts(torch.tensor(llava), 9, (2, 2, 2)).tolist() == [1, 3, 6]
    assert image_lengths([5, 6], 9) == () and image_lengths([5, 9], None) == () and image_runs([], 9) == []
    with pytest.raises(ValueError, match="position 6 has 3 tokens"):
        image_lengths([5, 9, 9, 9, 9, 6, 9, 9, 9], 9, 2)

    padded = torch.randn(2, 3, 4)  # two Qwen images of 2 and 3 tokens, padded to 3
    assert feature_lengths(qwen, 9, padded) == (2, 3)
    torch.testing.assert_close(unpad(padded, (2, 3)), torch.cat([padded[0, :2], padded[1]]))
    assert feature_lengths(qwen, 9, torch.randn(2, 7, 4)) == (2, 3)  # padded past the longest: still fine
    same = torch.randn(3, 2, 4)  # LLaVA: N_img * T = the image tokens, touching runs split by T
    assert feature_lengths(llava, 9, same) == (2, 2, 2) and torch.equal(unpad(same, (2, 2, 2)), same.reshape(-1, 4))
    assert feature_lengths(llava, 9, same, fixed=2) == (2, 2, 2) and feature_lengths([5], 9, None) == ()
    for ids, f, fixed, match in [(qwen, None, None, "got None"), (qwen, torch.randn(2, 3), None, r"\(2, 3\)"),
                                 (qwen, torch.randn(1, 5, 4), None, "2 image"),  # one image's features for two
                                 (qwen, torch.randn(2, 2, 4), None, "at most 2"),  # an image longer than T_max
                                 (llava, torch.randn(1, 6, 4), 2, "3 image"),  # the fixed count knows: 3 images
                                 (llava, torch.randn(3, 2, 4), 3, "whole number")]:
        with pytest.raises(ValueError, match=match):
            feature_lengths(ids, 9, f, fixed)
