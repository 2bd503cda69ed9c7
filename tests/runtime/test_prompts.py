"""One prompt path (runtime/engine/prompts.py): each family's own chat template and image tokens, checked against
prompts written out by hand; ``specula generate --model DIR`` and ``specula bench spec`` on the stock layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from specula.cli import main
from specula.runtime.engine.prompts import encode_messages, encode_prompt, marked_parts, prompt_messages
from specula.targets.processor import load_processor
from specula.world.tokenizer import CHAT_TEMPLATE, format_turns
from specula.zoo.store import resolve

SAMPLE = Path(__file__).resolve().parents[2] / "world" / "assets" / "sample.png"  # 168 x 168
SYSTEM = "You are a careful assistant."
QUESTION = "What colour is the star?"
CONVERSATION = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def sample() -> Image.Image:
    return Image.open(SAMPLE).convert("RGB")


def ids_of(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def test_llava15_renders_the_hub_format_with_576_image_tokens(llava15_dir):
    processor = load_processor(llava15_dir)
    tok = processor.tokenizer
    p = encode_messages(processor, CONVERSATION, [sample()])
    expected = f"{SYSTEM} USER: " + "<image>" * 576 + f"\n{QUESTION} ASSISTANT:"
    assert p.input_ids.tolist() == ids_of(tok, expected, special=True)
    image = tok.convert_tokens_to_ids("<image>")
    ids = p.input_ids.tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # <s> once, from the tokenizer
    assert ids.count(image) == 576 and ids[ids.index(image):ids.index(image) + 576] == [image] * 576
    assert p.pixel_values.shape == (1, 3, 336, 336) and p.image_grid_thw is None
    # a world prompt with its <image> mark, no system: the same format
    q = encode_prompt(processor, "<image>" + QUESTION, [sample()])
    assert q.input_ids.tolist() == ids_of(tok, "USER: " + "<image>" * 576 + f"\n{QUESTION} ASSISTANT:", True)


def test_qwen25vl_renders_chatml_with_the_grid_s_image_pads(qwen25vl_dir):
    processor = load_processor(qwen25vl_dir)
    tok = processor.tokenizer
    p = encode_messages(processor, CONVERSATION, [sample()])
    # 168 px: a 12 x 12 patch grid (patch 14), merged 2 x 2 -> 36 image tokens
    assert p.image_grid_thw.tolist() == [[1, 12, 12]] and p.pixel_values.shape == (144, 3 * 2 * 14 * 14)
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                + "<|image_pad|>" * 36 + f"<|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert p.input_ids.tolist() == ids_of(tok, expected, special=True)
    assert p.input_ids.tolist().count(tok.convert_tokens_to_ids("<|image_pad|>")) == 36
    assert p.mm_token_type_ids.tolist() == [int(t == tok.convert_tokens_to_ids("<|image_pad|>"))
                                            for t in p.input_ids.tolist()]
    # no system message: the template's default one
    q = encode_prompt(processor, QUESTION, [sample()])
    assert q.input_ids.tolist() == ids_of(tok, expected.replace(SYSTEM, "You are a helpful assistant."), True)
    # text only: no pixels, no grid
    r = encode_prompt(processor, QUESTION)
    assert r.pixel_values is None and r.image_grid_thw is None
    assert r.input_ids.tolist() == ids_of(tok, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                                               f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n", True)


def test_embedded_target_renders_what_format_turns_did():
    processor = load_processor(resolve("target"))
    assert processor.chat_template == CHAT_TEMPLATE  # shipped in the target's own directory, as a hub copy ships it
    tok = processor.tokenizer
    p = encode_messages(processor, CONVERSATION, [sample()])
    expected = f"<s><|system|>{SYSTEM}<|user|>" + "<image>" * 144 + f"{QUESTION}<|assistant|>"
    assert p.input_ids.tolist() == ids_of(tok, expected, special=False)
    assert p.input_ids.tolist() == ids_of(tok, format_turns("<image>" * 144 + QUESTION, system=SYSTEM), False)
    assert p.pixel_values.shape == (1, 3, 168, 168)
    # images placed by the world's marks stay where the marks are
    q = encode_prompt(processor, f"Image 1: <image> Image 2: <image> {QUESTION}", [sample(), sample()])
    marks = "Image 1: " + "<image>" * 144 + " Image 2: " + "<image>" * 144 + f" {QUESTION}"
    assert q.input_ids.tolist() == ids_of(tok, format_turns(marks), special=False)


def test_world_marks_become_image_parts():
    assert marked_parts("<image>Describe it.") == [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    assert marked_parts("A: <image><image> B") == [{"type": "text", "text": "A: "}, {"type": "image"},
                                                   {"type": "image"}, {"type": "text", "text": " B"}]
    assert prompt_messages("Which?", 2)[0]["content"] == [{"type": "image"}, {"type": "image"},
                                                          {"type": "text", "text": "Which?"}]
    assert prompt_messages("hi", 0, system="S")[0] == {"role": "system", "content": [{"type": "text", "text": "S"}]}
    with pytest.raises(ValueError, match="1 '<image>' marks for 2 images"):
        prompt_messages("<image>hi", 2)


@pytest.mark.parametrize("fixture", ["llava15_dir", "qwen25vl_dir"])
def test_generate_on_a_stock_checkpoint_is_lossless(fixture, request, capsys):
    path = request.getfixturevalue(fixture)
    rc = main(["generate", "--model", str(path), "--image", str(SAMPLE), "--question", QUESTION, "--drafter", "ngram",
               "--max-tokens", "8", "--repeats", "1", "--threads", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["identical"] is True and r["new_tokens"] > 0 and isinstance(r["answer"], str)
    assert r["prompt_tokens"] == encode_prompt(load_processor(path), QUESTION, [sample()]).input_ids.numel()
    # a system message goes through the template too
    rc = main(["generate", "--model", str(path), "--image", str(SAMPLE), "--question", QUESTION, "--system", SYSTEM,
               "--drafter", "none", "--max-tokens", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["prompt_tokens"] == encode_prompt(load_processor(path), QUESTION, [sample()], SYSTEM).input_ids.numel()
    # the old flag name still works, and plain decoding prints its answer
    rc = main(["generate", "--target", str(path), "--image", str(SAMPLE), "--question", QUESTION, "--drafter", "none",
               "--max-tokens", "8", "--threads", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "plain decoding:" in out and f"model {path}" in out


def test_bench_spec_on_qwen_uses_its_own_hf_class(qwen25vl_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from specula.runtime.bench.spec import BenchConfig, load, run

    loaded = load(str(qwen25vl_dir))
    assert type(loaded[3]) is Qwen2_5_VLForConditionalGeneration
    cfg = BenchConfig(model=str(qwen25vl_dir), drafters=({"kind": "ngram"},), suites=("caption", "text"),
                      n_per_suite=1, max_tokens=6, out=str(tmp_path))
    r = run(cfg, log=lambda *a: None, loaded=loaded)
    assert r["configs"]["ngram@5"]["greedy_exact"] is True
    assert r["configs"]["hf"]["seconds"] > 0


def test_hf_inputs_drive_the_stock_qwen_model_to_our_target_s_greedy_tokens(qwen25vl_dir):
    """HF generate with ``hf_inputs`` (grid and mm_token_type_ids included, so its mrope is right) emits what our
    target's plain greedy decoding does: both read the one prompt the same way."""
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.bench.spec import load

    _, processor, target, hf = load(str(qwen25vl_dir))
    p = encode_prompt(processor, "<image>" + QUESTION, [sample()])
    with torch.no_grad():
        out = hf.generate(**p.hf_inputs(), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=processor.tokenizer.pad_token_id)
    ours = SpecEngine(target, None, eos_token_ids=()).generate([p.request("q", SamplingParams(max_tokens=6))])["q"]
    assert out[0, p.input_ids.numel():].tolist() == ours.tokens


@pytest.mark.parametrize("fixture", ["llava15_dir", "qwen25vl_dir", None])
def test_the_serving_front_door_builds_the_same_prompt(fixture, request):
    """POST /generate's body (``<image>`` marks) and an OpenAI chat message through IngressEngine give the tokens,
    pixels and grid that ``encode_prompt`` gives (``specula generate``, the benches)."""
    import base64

    from specula.runtime.config import LimitsConfig
    from specula.runtime.serve.ingress import IngressEngine

    path = request.getfixturevalue(fixture) if fixture else resolve("target")
    processor = load_processor(path)
    ingress = IngressEngine(processor, LimitsConfig())
    want = encode_prompt(processor, "<image>" + QUESTION, [sample()])
    body = ingress.parse({"prompt": "<image>" + QUESTION, "images": [base64.b64encode(SAMPLE.read_bytes()).decode()],
                          "max_tokens": 4})
    got = ingress.prepare(body, "r")
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.pixel_values, want.pixel_values)
    assert (got.image_grid_thw is None) == (want.image_grid_thw is None)
    if want.image_grid_thw is not None:
        assert torch.equal(got.image_grid_thw, want.image_grid_thw)
