"""``python -m research probe-content``: the ridge probe, the patches it reads, and the command's output."""

import json

import pytest
import torch

from research.cli import main
from specula.targets.processor import load_processor
from specula.world import generate
from specula.world.vocab import COLOUR_NAMES
from research.content_probe import (PROBE_OFFSET, base_accuracy, collect, isolation_mask, probe_content,
                                      ridge_accuracy)
from specula.zoo.store import TOKENIZER_DIR
from specula.training.target.referents import eager_attention
from specula.targets.embedded_arch import TargetArch, build_model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    processor = load_processor(TOKENIZER_DIR)
    return build_model(TargetArch.from_name("tiny"), processor.tokenizer).eval(), processor


def test_ridge_reads_a_linear_code_and_not_noise():
    g = torch.Generator().manual_seed(0)
    code = torch.randn(len(COLOUR_NAMES), 32, generator=g)  # one direction per class
    y = torch.randint(0, len(COLOUR_NAMES), (400,), generator=g)
    x = code[y] + 0.3 * torch.randn(400, 32, generator=g)  # [N, H]
    assert ridge_accuracy(x[:200], y[:200], x[200:], y[200:], len(COLOUR_NAMES)) > 0.95
    noise = torch.randn(400, 32, generator=g)
    assert ridge_accuracy(noise[:200], y[:200], noise[200:], y[200:], len(COLOUR_NAMES)) < 0.35
    assert base_accuracy(torch.tensor([2, 2, 1]), torch.tensor([2, 0, 2, 1])) == 0.5
    with pytest.raises(ValueError, match="both halves"):
        ridge_accuracy(x[:0], y[:0], x, y, len(COLOUR_NAMES))


@torch.no_grad()
def test_the_same_patches_alone_and_in_the_set_start_from_the_same_visual_tokens(tiny):
    model, processor = tiny
    s = next(s for s in (generate("multi_image", "eval", PROBE_OFFSET + i) for i in range(40))
             if s.kind == "multi/which" and len(s.images) >= 3)
    parts = collect(model, processor, s)
    layers = model.config.text_config.num_hidden_layers
    in_set = torch.cat([parts["set_first"][0], parts["set_later"][0]], 1)  # [L + 1, P, H]
    alone, labels = parts["alone"]
    assert in_set.shape == alone.shape and in_set.shape[0] == layers + 1
    assert torch.equal(torch.cat([parts["set_first"][1], parts["set_later"][1]]), labels)
    # layer 0's input is the projector's output: the same image tokens wherever the image sits
    torch.testing.assert_close(in_set[0], alone[0])
    assert not torch.allclose(in_set[-1], alone[-1])  # ... and the set's text and other images change what follows
    assert labels.shape[0] > 0 and (labels[:, 0] < len(COLOUR_NAMES)).all()


def test_the_isolation_mask_keeps_an_image_off_the_other_images_and_the_text():
    # prefix (2) | "Image 1:" (2) | image 0 (3) | text (1) | image 1 (3) | question (2)
    ids = torch.tensor([1, 2, 5, 6, 9, 9, 9, 7, 9, 9, 9, 8, 8])
    m = isolation_mask(ids, image_id=9, tokens_per_image=3, prefix=2)  # [T, T]
    assert m[4].tolist() == [True, True, False, False, True] + [False] * 8  # image 0's first token: prefix and itself
    assert m[10].tolist() == [True, True] + [False] * 6 + [True, True, True, False, False]  # image 1: not image 0
    assert m[12].tolist() == [True] * 13 and m[7].tolist() == [True] * 8 + [False] * 5  # text: plain causal
    assert not m.triu(1).any()


@torch.no_grad()
def test_an_isolated_set_holds_what_its_images_hold_alone(tiny):
    model, processor = tiny
    s = next(s for s in (generate("multi_image", "eval", PROBE_OFFSET + i) for i in range(80))
             if s.kind == "multi/which" and len(s.images) >= 3 and "Image 1:" in s.prompt)
    causal, isolated = collect(model, processor, s), collect(model, processor, s, isolate=True)
    alone = causal["alone"][0]  # [L + 1, P, H]
    first = causal["set_first"][0].shape[1]

    def gap(parts):  # the largest difference from alone after layer 0, first image and later ones
        return [float((parts[g][0][1:] - part[1:]).abs().max())
                for g, part in (("set_first", alone[:, :first]), ("set_later", alone[:, first:]))]

    assert min(gap(causal)) > 0.1  # the marker text and the earlier images change what the patches hold
    assert max(gap(isolated)) < 0.05  # ... and without them only the positions differ
    with eager_attention(model.model.language_model):  # the mask made additive for eager attention
        eager = collect(model, processor, s, isolate=True)
    torch.testing.assert_close(eager["set_later"][0], isolated["set_later"][0], atol=1e-4, rtol=1e-4)


def test_a_probe_reports_every_layer_of_every_group(tiny):
    model, processor = tiny
    r = probe_content(model, processor, n=4, progress=False)
    assert r["sets"] == 4 and set(r["groups"]) == {"set_first", "set_later", "alone"}
    for g in r["groups"].values():
        assert len(g["by_layer"]) == r["layers"] + 1 and all(p > 0 for p in g["patches"])
        assert all(0.0 <= v <= 1.0 for row in g["by_layer"] for v in row) and len(g["base"]) == 2


def test_the_command_writes_json_and_markdown(tiny, tmp_path, capsys):
    model, processor = tiny
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    assert main(["probe-content", "--model", str(tmp_path / "m"), "--n", "2", "--threads", "1",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "probe_content.json").read_text())
    assert report["model"] == str(tmp_path / "m") and report["sets"] == 2 and not report["isolated"]
    md = (tmp_path / "out" / "probe_content.md").read_text()
    assert md.startswith("| where |") and "layer 0's input" in md and "| where |" in capsys.readouterr().out
    assert main(["probe-content", "--model", str(tmp_path / "m"), "--n", "2", "--threads", "1", "--isolate",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["isolated"] is True
    with pytest.raises(SystemExit, match="--n must be at least 2"):
        main(["probe-content", "--model", str(tmp_path / "m"), "--n", "1"])
