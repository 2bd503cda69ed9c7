"""The count key fit: the count head's keys seeded with each summary token's shapes, its query zeroed there (the
slow rotary pairs, the ridge fit, what the fit writes and leaves alone, the run stage that does it once, the flag)."""

import copy
import dataclasses
import json
import random

import pytest
import torch

from specula.targets.processor import load_processor
from specula.world.vocab import SHAPES
from specula.training.target.batching import Encoder
from specula.training.target.cli import parse_config
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.set_count import COUNT_HEAD, COUNT_LAYER
from specula.training.target.referents import eager_attention
from specula.training.target.set_count_fit import (KEY_SCALE, collect_summaries, count_hop_loss, fit_count_keys, ridge_fit,
                                       slow_pairs)
from specula.targets.embedded_arch import TargetArch, build_model
from specula.training.target.train import TrainConfig, train


@pytest.fixture(scope="module")
def processor():
    p = copy.copy(load_processor(TOKENIZER_DIR))
    p.number_images = True  # summary tokens need the "Image n:" markers
    return p


def test_the_slow_pairs_are_the_last_of_each_half():
    assert slow_pairs(64, 6) == (26, 27, 28, 29, 30, 31)
    assert slow_pairs(16, 6) == (2, 3, 4, 5, 6, 7)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="rotary pairs"):
            slow_pairs(16, bad)


def test_the_ridge_fit_reads_a_linear_code():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 12, generator=g)
    a_true = torch.randn(3, 12, generator=g)
    y = (x @ a_true.T > 0).float()
    a = ridge_fit(x, y)
    assert a.shape == (3, 12)
    assert float(((x @ a.T > 0).float() == y).float().mean()) > 0.9


def test_the_fit_writes_the_count_heads_keys_and_zeroes_its_query_there_and_nothing_else(processor):
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval()
    enc = Encoder(processor, set_count=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit = fit_count_keys(model, enc, 4, seed=0, log=lambda *a: None, progress=False)
    hd = model.config.text_config.head_dim
    half = hd // 2
    assert fit.dims == slow_pairs(hd, len(SHAPES)) and fit.dialogues == 4 and fit.summaries > 4
    assert 0.0 <= fit.probe_accuracy <= 1.0 and 0.0 <= fit.base_rate <= 1.0
    prefix = f"model.language_model.layers.{COUNT_LAYER}.self_attn."
    rows = [COUNT_HEAD * hd + d + o for d in fit.dims for o in (0, half)]
    after = model.state_dict()
    for k, v in after.items():
        if k in (prefix + "k_proj.weight", prefix + "q_proj.weight"):
            keep = [r for r in range(v.shape[0]) if r not in rows]
            assert torch.equal(v[keep], before[k][keep]), k  # every other head and dimension as it was
        else:
            assert torch.equal(v, before[k]), k
    wk, wq = after[prefix + "k_proj.weight"], after[prefix + "q_proj.weight"]
    # the count layer's input does not depend on the count layer: the same reading gives the same fit
    x, y, _ = collect_summaries(model, enc, 4, seed=0, progress=False)
    a = ridge_fit(x, y)
    for j, d in enumerate(fit.dims):
        base = COUNT_HEAD * hd + d
        assert torch.allclose(wk[base], KEY_SCALE * a[j], atol=1e-5)
        assert not wk[base].eq(0).all()
        assert wk[base + half].eq(0).all() and wq[base].eq(0).all() and wq[base + half].eq(0).all()


def test_the_fit_refuses_an_encoder_without_count_targets_and_too_few_dialogues(processor):
    model = build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval()
    with pytest.raises(ValueError, match="set_count=True"):
        fit_count_keys(model, Encoder(processor), 4, seed=0, log=lambda *a: None, progress=False)
    with pytest.raises(ValueError, match="at least 2 dialogues"):
        fit_count_keys(model, Encoder(processor, set_count=True), 1, seed=0, log=lambda *a: None, progress=False)
    shared = build_model(dataclasses.replace(TargetArch.from_name("tiny_deep"), lm_kv_heads=2), processor.tokenizer)
    with pytest.raises(ValueError, match="as many key-value heads as query heads"):
        fit_count_keys(shared, Encoder(processor, set_count=True), 4, seed=0, log=lambda *a: None, progress=False)
    unnumbered = copy.copy(processor)
    unnumbered.number_images = False  # half the prompts carry markers of their own: the fit still finds some
    x, _, rows = collect_summaries(model, Encoder(unnumbered, set_count=True), 2, seed=0, progress=False)
    assert len(x) > 0 and set(rows.tolist()) == {0, 1}


def test_a_run_fits_once_and_a_resumed_run_keeps_the_fit(processor, tmp_path):
    base = dict(pool=16, token_budget=4096, warmup_samples=2, eval_n=2, eval_every_s=1e9, ckpt_every_s=1e9,
                threads=1, vision_images=8, mix="scan_multi", number_images=True, arch="tiny_deep", set_count=1.0,
                set_count_key_fit=3, set_count_query_steps=3, run_dir=str(tmp_path / "run"))
    logs: list[str] = []
    ckpt = train(TrainConfig(total_samples=16, **base), processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["count_key_fit"]["dialogues"] == 3 and state["count_key_fit"]["at_samples"] == 0
    assert state["count_key_fit"]["query_steps"] == 3
    assert sum("count key fit" in m for m in logs) == 1 and sum("count query fit" in m for m in logs) == 1
    train(TrainConfig(total_samples=32, **base), processor, log=logs.append)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["samples"] >= 32 and state["count_key_fit"]["at_samples"] == 0
    assert sum("count key fit" in m for m in logs) == 1  # not fitted again on resuming
    # a run started from that checkpoint (a lane restored elsewhere) keeps its fit too
    train(TrainConfig(total_samples=48, **{**base, "run_dir": str(tmp_path / "next"), "init_from": str(ckpt)}),
          processor, log=logs.append)
    assert sum("count key fit" in m for m in logs) == 1
    nxt = json.loads((tmp_path / "next" / "ckpt" / "state.json").read_text())
    assert nxt["count_key_fit"] == state["count_key_fit"]


def test_the_flag_reaches_the_config_and_needs_the_count_targets_on_numbered_sets(tmp_path):
    cfg = parse_config(["--set-count", "1", "--number-images", "--set-count-key-fit", "200",
                        "--set-count-query-steps", "50"])
    assert cfg.set_count_key_fit == 200
    assert cfg.set_count_query_steps == 50
    with pytest.raises(ValueError, match="set_count_query_steps"):
        TrainConfig(run_dir=str(tmp_path), set_count_query_steps=5, set_count=1.0, number_images=True)
    assert parse_config([]).set_count_key_fit == 0
    for bad in (dict(set_count_key_fit=10), dict(set_count_key_fit=10, set_count=1.0),
                dict(set_count_key_fit=-1, set_count=1.0, number_images=True)):
        with pytest.raises(ValueError, match="set_count_key_fit"):
            TrainConfig(run_dir=str(tmp_path), **bad)
    TrainConfig(run_dir=str(tmp_path), set_count_key_fit=10, set_count_readout=1.0, number_images=True)


def test_the_count_hop_loss_is_the_models_own_attention(processor):
    """count_hop_loss recomputes the count head's attention from the cached layer input (rotary tables, scale,
    causal softmax): it must equal -mean log of the weights the model's eager attention returns."""
    torch.manual_seed(1)
    model = build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval()
    enc = Encoder(processor, set_count=True)
    rows: list = []
    collect_summaries(model, enc, 3, seed=2, progress=False, keep_rows=rows)
    assert rows and all(r.turns for r in rows)
    attn = model.model.language_model.layers[COUNT_LAYER].self_attn
    hd = model.config.text_config.head_dim
    sl = slice(COUNT_HEAD * hd, (COUNT_HEAD + 1) * hd)
    got = float(count_hop_loss(attn.q_proj.weight[sl].detach(), attn.k_proj.weight[sl].detach(), rows,
                               attn.scaling))
    from specula.world.image_sets import make_multi_dialogue

    want, i, seen = [], 0, 0
    lm = model.model.language_model
    while seen < 3:  # the same dialogues collect_summaries read
        s = make_multi_dialogue(random.Random(f"count-key-fit/2/{i}"), "multi_image", "dialogue")
        i += 1
        e = enc.encode(s)
        if not [t for t in e.referents if t.group == "set_count" and t.says]:
            continue
        seen += 1
        with torch.no_grad(), eager_attention(lm):
            out = model(input_ids=e.input_ids[None], pixel_values=e.pixel_values,
                        attention_mask=torch.ones_like(e.input_ids)[None], output_attentions=True)
        w = out.attentions[COUNT_LAYER][0, COUNT_HEAD]  # [L, L]
        want += [float(-w[t.query, list(t.patches)].log().mean()) for t in e.referents
                 if t.group == "set_count" and t.spread and t.patches]
    assert got == pytest.approx(sum(want) / len(want), rel=1e-4)


def test_the_query_fit_lowers_the_count_hop_loss_and_moves_only_the_count_heads_query(processor):
    torch.manual_seed(0)
    model = build_model(TargetArch.from_name("tiny_deep"), processor.tokenizer).eval()
    enc = Encoder(processor, set_count=True)
    keys_only = copy.deepcopy(model)
    fit_count_keys(keys_only, enc, 4, seed=0, log=lambda *a: None, progress=False)
    fit = fit_count_keys(model, enc, 4, seed=0, log=lambda *a: None, progress=False, query_steps=20)
    assert fit.query_steps == 20 and fit.query_loss_after < fit.query_loss_before
    hd = model.config.text_config.head_dim
    prefix = f"model.language_model.layers.{COUNT_LAYER}.self_attn."
    a, b = model.state_dict(), keys_only.state_dict()
    for k in a:
        if k == prefix + "q_proj.weight":
            other = [r for r in range(a[k].shape[0]) if not COUNT_HEAD * hd <= r < (COUNT_HEAD + 1) * hd]
            assert torch.equal(a[k][other], b[k][other]) and not torch.equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k  # the keys as the key fit wrote them, everything else untouched
