"""``specula generate --model DIR --drafter KIND|DIR`` on the stock LLaVA-1.5 and Qwen2.5-VL layouts: a drafter
directory's record is checked against the model as ``specula serve`` checks it (runtime/config_records.py), a
mismatch naming both fingerprints (exit 2, no traceback); a directory trained for the model drafts for it; the
default drafter, whose shipped weights are the embedded target's, falls back to ngram with a note on stderr."""

from __future__ import annotations

import json

import pytest

from specula.cli import main
from specula.zoo.store import drafter_record, resolve, weights_fingerprint

LAYOUTS = ["llava15_dir", "qwen25vl_dir"]


def _generate(capsys, model, image, *extra: str) -> tuple[int, str, str]:
    rc = main(["generate", "--model", str(model), "--image", str(image), "--question", "What is it?",
               "--max-tokens", "6", "--repeats", "1", "--threads", "1", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("generate") / "block.png"
    Image.new("RGB", (40, 32), (220, 30, 30)).save(path)
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_drafter_dir_trained_for_other_weights_is_refused_naming_both(layout, request, image, tmp_path, capsys):
    model = request.getfixturevalue(layout)
    other = tmp_path / "eagle-for-another"
    other.mkdir()
    (other / "specula.json").write_text(json.dumps({"kind": "eagle", "target_sha256": "f" * 64}))
    rc, _, err = _generate(capsys, model, image, "--drafter", str(other))
    assert rc == 2 and "Traceback" not in err
    assert "ffffffffffffffff" in err and weights_fingerprint(model)[:16] in err
    assert str(other) in err and str(model) in err and "specula train eagle --target" in err
    # a shipped drafter named explicitly is checked the same way (its weights are the embedded target's)
    rc, _, err = _generate(capsys, model, image, "--drafter", "flash")
    assert rc == 2 and drafter_record(resolve("flash"))["target_sha256"][:16] in err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_default_drafter_falls_back_to_ngram_on_a_stock_checkpoint(layout, request, image, capsys):
    rc, out, err = _generate(capsys, request.getfixturevalue(layout), image, "--json")
    assert rc == 0
    assert "default drafter 'flash' was trained for another target" in err and "drafting with 'ngram'" in err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["drafter"] == "ngram" and r["drafter_path"] is None and r["identical"] is True


def test_a_drafter_dir_trained_for_the_model_drafts_for_it(llava15_dir, image, tmp_path, capsys):
    """The target's own LM exported as a text_lm drafter directory, its record naming the model's fingerprint."""
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(llava15_dir)
    lm = LlamaForCausalLM(hf.config.text_config)
    lm.model.load_state_dict(hf.model.language_model.state_dict())
    lm.tie_weights()
    out = tmp_path / "text_lm"
    lm.eval().save_pretrained(out)
    (out / "specula.json").write_text(json.dumps({"kind": "text_lm", "image_token_id": hf.config.image_token_id,
                                                  "target_sha256": weights_fingerprint(llava15_dir)}))
    rc, stdout, err = _generate(capsys, llava15_dir, image, "--drafter", str(out), "--gamma", "3", "--json")
    assert rc == 0 and "drafting with" not in err
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["drafter"] == "text_lm" and r["drafter_path"] == str(out)
    assert r["identical"] is True and r["alpha"]  # it drafted, and greedy output equals plain decoding's
