"""The stock-layout fixtures (tests/stock_checkpoints.py): hub-shaped directories that our loaders, the stock HF
classes and the engine all read, with the real checkpoints' geometry and image-token counts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image

from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import encode_prompt, eos_ids
from specula.targets import load_target
from specula.targets.llava import LlavaTarget
from specula.targets.processor import LlavaPilProcessor, load_processor, processor_kind
from specula.targets.qwen2_5_vl import Qwen2_5_VLTarget
from specula.targets.qwen_processor import Qwen2_5_VLPilProcessor

from stock_checkpoints import build_llava15

SAMPLE = Path(__file__).resolve().parents[2] / "world" / "assets" / "sample.png"
HUB_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "processor_config.json"}


def files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_llava15_layout(llava15_dir):
    assert HUB_FILES <= files(llava15_dir)
    cfg = json.loads((llava15_dir / "config.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert (cfg["vision_config"]["image_size"], cfg["vision_config"]["patch_size"]) == (336, 14)
    assert cfg["vision_feature_layer"] == -2 and cfg["vision_feature_select_strategy"] == "default"
    assert cfg["projector_hidden_act"] == "gelu" and cfg["text_config"]["model_type"] == "llama"
    tok_cfg = json.loads((llava15_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "LlamaTokenizer" and tok_cfg["processor_class"] == "LlavaProcessor"
    proc = json.loads((llava15_dir / "processor_config.json").read_text())
    assert proc["processor_class"] == "LlavaProcessor"
    assert proc["image_processor"]["image_processor_type"] == "CLIPImageProcessor"
    processor = load_processor(llava15_dir)
    assert isinstance(processor, LlavaPilProcessor) and processor_kind(llava15_dir) == "llava"
    assert isinstance(load_target(llava15_dir), LlavaTarget)


def test_qwen25vl_layout(qwen25vl_dir):
    assert HUB_FILES <= files(qwen25vl_dir)
    cfg = json.loads((qwen25vl_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    v = cfg["vision_config"]
    assert (v["patch_size"], v["spatial_merge_size"], v["window_size"], v["fullatt_block_indexes"]) == (14, 2, 112, [1])
    tok_cfg = json.loads((qwen25vl_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "Qwen2Tokenizer" and tok_cfg["eos_token"] == "<|im_end|>"
    proc = json.loads((qwen25vl_dir / "processor_config.json").read_text())
    assert proc["processor_class"] == "Qwen2_5_VLProcessor"
    assert proc["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
    processor = load_processor(qwen25vl_dir)
    assert isinstance(processor, Qwen2_5_VLPilProcessor) and processor_kind(qwen25vl_dir) == "qwen2_5_vl"
    target = load_target(qwen25vl_dir)
    assert isinstance(target, Qwen2_5_VLTarget)
    assert eos_ids(processor.tokenizer, target) == [processor.tokenizer.convert_tokens_to_ids(t)
                                                   for t in ("<|im_end|>", "<|endoftext|>")]


def test_tokenizers_round_trip_any_text(llava15_dir, qwen25vl_dir):
    text = "Zürich: 3 ☆ stars, naïve café!\n"  # characters the corpus never saw: bytes
    for d in (llava15_dir, qwen25vl_dir):
        tok = load_processor(d).tokenizer
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_builds_are_deterministic(llava15_dir, tmp_path):
    again = build_llava15(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (llava15_dir / name).read_bytes()


def test_each_image_prompt_prefills_and_matches_the_stock_forward(llava15_dir, qwen25vl_dir):
    image = Image.open(SAMPLE).convert("RGB")
    for d in (llava15_dir, qwen25vl_dir):
        processor, target = load_processor(d), load_target(d)
        p = encode_prompt(processor, "<image>Describe the image.", [image])
        out = target.prefill([p.prefill("r")])
        with torch.no_grad():
            ref = target.model(**p.hf_inputs()).logits[0, -1]  # [V]
        torch.testing.assert_close(out.logits[0], ref, rtol=1e-4, atol=1e-4)
        target.release(["r"])
        res = SpecEngine(target, None, eos_token_ids=()).generate([p.request("g", SamplingParams(max_tokens=3))])
        assert len(res["g"].tokens) == 3
