"""load_processor on local checkpoint directories (Qwen2.5-VL and llava-hf layouts) without torchvision.

Tiny checkpoints are written here the way ``save_pretrained`` writes them and the way the hub checkpoints
(``Qwen/Qwen2.5-VL-7B-Instruct``, ``llava-hf/llava-1.5-7b-hf``) lay them out; the processor's output must drive
``target.prefill`` to the stock model's logits.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoProcessor, PreTrainedTokenizerFast
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from specula.targets import PrefillRequest, load_target
from specula.targets.processor import LlavaPilProcessor, build_processor, load_processor, processor_kind
from specula.targets.qwen_processor import Qwen2_5_VLPilProcessor

from tiny_targets import LLAVA_IMAGE, QWEN_END, QWEN_IMAGE, QWEN_START, QWEN_VIDEO, tiny_llava, tiny_qwen

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

QWEN_SPECIAL = {
    QWEN_IMAGE: "<|image_pad|>", QWEN_VIDEO: "<|video_pad|>",
    QWEN_START: "<|vision_start|>", QWEN_END: "<|vision_end|>",
    124: "<|im_start|>", 125: "<|im_end|>", 126: "<|endoftext|>", 127: "<|vision_pad|>",
}
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def word_tokenizer(vocab_size: int, special: dict[int, str], template: str, **tokens) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: ids not in ``special`` are words ``w<i>`` (0 = <unk>)."""
    vocab = {("<unk>" if i == 0 else f"w{i}"): i for i in range(vocab_size) if i not in special}
    vocab.update({t: i for i, t in special.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=template, **tokens)


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(128, QWEN_SPECIAL, QWEN_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def llava_tokenizer() -> PreTrainedTokenizerFast:
    special = {LLAVA_IMAGE: "<image>", 1: "<s>", 2: "</s>", 98: "<pad>"}
    return word_tokenizer(100, special, LLAVA_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def write_json(path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    """{"saved": our processor's save_pretrained, "hub"/"hub_fast": Qwen2.5-VL-7B-Instruct's file layout}."""
    model = tiny_qwen()
    dirs = {}
    # save_pretrained of model + processor
    saved = tmp_path_factory.mktemp("qwen_saved")
    model.save_pretrained(saved)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4, temporal_patch_size=2, merge_size=2,
        image_mean=CLIP_MEAN, image_std=CLIP_STD,
    )
    tok = qwen_tokenizer()
    processor = Qwen2_5_VLPilProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template)
    processor.save_pretrained(saved)
    dirs["saved"] = saved
    # The hub layout: preprocessor_config.json (no processor_config.json), chat_template.json, no video config;
    # "hub_fast": the same naming the legacy fast class, as some re-uploads do.
    for name, image_processor_type in (("hub", "Qwen2VLImageProcessor"), ("hub_fast", "Qwen2VLImageProcessorFast")):
        hub = tmp_path_factory.mktemp(f"qwen_{name}")
        model.save_pretrained(hub)
        qwen_tokenizer().save_pretrained(hub)
        (hub / "chat_template.jinja").unlink(missing_ok=True)
        write_json(hub / "chat_template.json", {"chat_template": QWEN_TEMPLATE})
        write_json(hub / "preprocessor_config.json", {
            "min_pixels": 16 * 16, "max_pixels": 48 * 48, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
            "image_processor_type": image_processor_type, "processor_class": "Qwen2_5_VLProcessor",
        })
        dirs[name] = hub
    return dirs


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    """llava-1.5-7b-hf's layout: preprocessor_config.json naming the stock (torchvision) CLIPImageProcessor,
    with ("hub") and without ("old", early snapshots) processor_config.json."""
    model = tiny_llava()
    dirs = {}
    for name in ("hub", "old"):
        d = tmp_path_factory.mktemp(f"llava_{name}")
        model.save_pretrained(d)
        llava_tokenizer().save_pretrained(d)
        (d / "chat_template.jinja").unlink(missing_ok=True)
        write_json(d / "chat_template.json", {"chat_template": LLAVA_TEMPLATE})
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        write_json(d / "tokenizer_config.json", {**cfg, "processor_class": "LlavaProcessor"})
        write_json(d / "preprocessor_config.json", {
            "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "do_convert_rgb": True,
            "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
            "image_processor_type": "CLIPImageProcessor", "image_std": CLIP_STD, "processor_class": "LlavaProcessor",
            "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": 28},
        })
        if name == "hub":
            write_json(d / "processor_config.json", {
                "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default",
            })
        dirs[name] = d
    return dirs


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def runs(ids: torch.Tensor, token: int) -> list[int]:
    """Lengths of the runs of ``token`` in a 1-D id tensor."""
    out, n = [], 0
    for t in ids.tolist() + [-1]:
        if t == token:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


@torch.no_grad()
def stock_last_logits(model, enc) -> torch.Tensor:
    if model.config.model_type == "qwen2_5_vl":
        model.model.rope_deltas = None
    out = model(**{k: v for k, v in enc.items() if k != "attention_mask"})
    return out.logits[:, -1].float()


@pytest.mark.parametrize("layout", ["saved", "hub", "hub_fast"])
def test_qwen_dir_processor_and_target(qwen_dirs, layout):
    d = qwen_dirs[layout]
    processor = load_processor(d)
    target = load_target(d, dtype="float32")
    assert "torchvision" not in sys.modules
    assert processor_kind(d) == "qwen2_5_vl"
    assert type(processor) is Qwen2_5_VLPilProcessor
    assert type(processor.image_processor) is Qwen2VLImageProcessorPil
    assert processor.image_processor.patch_size == 4 and processor.chat_template == QWEN_TEMPLATE
    merge = processor.image_processor.merge_size

    cases = {  # different sizes and aspect ratios -> different grids
        "one": [picture(40, 24, 1)],
        "two": [picture(20, 33, 2), picture(47, 40, 3)],
    }
    requests, encs = [], []
    for rid, images in cases.items():
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "w5 w6 w7"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        enc = processor(text=[text], images=images, return_tensors="pt")
        grid = enc["image_grid_thw"]
        assert grid.shape == (len(images), 3)
        per_image = (grid.prod(dim=1) // merge**2).tolist()
        assert runs(enc["input_ids"][0], QWEN_IMAGE) == per_image  # one run per image, in order
        assert int((enc["mm_token_type_ids"] == 1).sum()) == sum(per_image)
        assert enc["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
        encs.append(enc)
        requests.append(PrefillRequest(rid, enc["input_ids"][0], enc["pixel_values"], grid))
    assert len({tuple(g) for e in encs for g in e["image_grid_thw"].tolist()}) == 3

    batched = target.prefill(requests).logits  # both rows in one call
    for i, enc in enumerate(encs):
        ref = stock_last_logits(target.model, enc)
        single = load_target(target.model).prefill([requests[i]]).logits
        torch.testing.assert_close(single, ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(batched[i : i + 1], ref, atol=1e-4, rtol=0)


def test_qwen_save_keeps_stock_names(qwen_dirs, tmp_path):
    cfg = json.loads((qwen_dirs["saved"] / "processor_config.json").read_text())
    assert cfg["processor_class"] == "Qwen2_5_VLProcessor"
    assert cfg["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
    assert "video_processor" not in cfg
    load_processor(qwen_dirs["hub"]).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    assert type(load_processor(tmp_path)) is Qwen2_5_VLPilProcessor


def test_stock_qwen_processor_still_needs_torchvision(qwen_dirs):
    """Why Qwen2_5_VLPilProcessor exists (transformers 5.23): the stock processor loads a torchvision-only video
    processor. If this starts passing, the stock class may do and the subclass can go."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed")
    with pytest.raises(ImportError, match="(?i)torchvision"):
        AutoProcessor.from_pretrained(str(qwen_dirs["hub"]), local_files_only=True)


@pytest.mark.parametrize("layout", ["hub", "old"])
def test_llava_hub_dir_processor_and_target(llava_dirs, layout):
    d = llava_dirs[layout]
    processor = load_processor(d)
    target = load_target(d, dtype="float32")
    assert "torchvision" not in sys.modules
    assert type(processor) is LlavaPilProcessor
    assert type(processor.image_processor) is CLIPImageProcessorPil
    assert processor.chat_template == LLAVA_TEMPLATE
    images = [picture(40, 31, 4), picture(28, 50, 5)]
    content = [{"type": "image"}, {"type": "text", "text": "w5 w6"}, {"type": "image"}, {"type": "text", "text": "w7"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    enc = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    # 28 px / patch 14 -> 4 patches, + CLS, "default" strategy drops CLS again -> 4 tokens per image
    assert runs(enc["input_ids"][0], LLAVA_IMAGE) == [4, 4]
    assert enc["pixel_values"].shape == (2, 3, 28, 28)
    out = target.prefill([PrefillRequest("r", enc["input_ids"][0], enc["pixel_values"])]).logits
    torch.testing.assert_close(out, stock_last_logits(target.model, enc), atol=1e-4, rtol=0)


def test_stock_autoprocessor_falls_back_to_pil_clip(llava_dirs):
    """transformers 5.23 without torchvision: a config naming CLIPImageProcessor loads CLIPImageProcessorPil."""
    processor = AutoProcessor.from_pretrained(str(llava_dirs["hub"]), local_files_only=True)
    assert type(processor.image_processor) is CLIPImageProcessorPil


def test_embedded_llava_round_trip(tmp_path):
    tok = llava_tokenizer()
    built = build_processor(tok, image_size=28, patch_size=14)
    built.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "processor_config.json").read_text())
    assert cfg["processor_class"] == "LlavaProcessor"
    assert cfg["image_processor"]["image_processor_type"] == "CLIPImageProcessor"
    assert processor_kind(tmp_path) == "llava"  # no config.json: from processor_class
    processor = load_processor(tmp_path)
    assert type(processor) is LlavaPilProcessor and type(processor.image_processor) is CLIPImageProcessorPil
    enc = processor(text=["w3 <image> w4"], images=[picture(30, 30, 6)], return_tensors="pt")
    assert runs(enc["input_ids"][0], LLAVA_IMAGE) == [4]


def test_processor_kind(tmp_path):
    write_json(tmp_path / "config.json", {"model_type": "qwen2_5_vl"})
    write_json(tmp_path / "processor_config.json", {"processor_class": "LlavaProcessor"})
    assert processor_kind(tmp_path) == "qwen2_5_vl"  # the model config wins
    write_json(tmp_path / "config.json", {"model_type": "llama"})
    assert processor_kind(tmp_path) == "llava"
    (tmp_path / "processor_config.json").unlink()
    assert processor_kind(tmp_path) is None
    with pytest.raises(ValueError, match="not a local directory"):
        load_processor(tmp_path / "missing")


@pytest.fixture(scope="module")
def processors(qwen_dirs, llava_dirs):
    return {"qwen": load_processor(qwen_dirs["saved"]), "llava": load_processor(llava_dirs["hub"])}


PLACEHOLDER = {"qwen": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}


@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_bad_images(processors, name, tmp_path):
    processor, ph = processors[name], PLACEHOLDER[name]
    text = f"w3 {ph} w4"
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"definitely not a png")
    with pytest.raises(ValueError, match=r"image 0: cannot read .*garbage\.png.* as an image"):
        processor(text=[text], images=[str(garbage)])
    with pytest.raises(ValueError, match=r"image 0: .*nope\.png' is not an existing file"):
        processor(text=[text], images=[tmp_path / "nope.png"])
    with pytest.raises(ValueError, match="is a URL"):
        processor(text=[text], images=["https://example.com/cat.png"])
    with pytest.raises(ValueError, match=r"image 1 is a int; expected a PIL image"):
        processor(text=[f"{ph} {ph}"], images=[picture(30, 30, 7), 3])
    truncated = tmp_path / "truncated.png"
    picture(64, 64, 8).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(ValueError, match="image 0: the PIL image cannot be decoded"):
        processor(text=[text], images=[Image.open(truncated)])
    # a readable file works
    good = tmp_path / "good.png"
    picture(30, 30, 9).save(good)
    assert processor(text=[text], images=[str(good)], return_tensors="pt")["pixel_values"].shape[0] > 0


@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_wrong_number_of_images(processors, name):
    processor, ph = processors[name], PLACEHOLDER[name]
    token = processor.image_token
    img = picture(30, 30, 10)
    one_for_two = rf"the prompt has 1 '{token}' placeholder\(s\) but 2 image\(s\)".replace("|", r"\|")
    with pytest.raises(ValueError, match=one_for_two):
        processor(text=[f"w3 {ph}"], images=[img, img])
    with pytest.raises(ValueError, match=r"has 2 .* placeholder\(s\) but 0 image\(s\)"):
        processor(text=[f"{ph} w3 {ph}"])
    with pytest.raises(ValueError, match=r"has 0 .* placeholder\(s\) but 1 image\(s\)"):
        processor(text=["w3 w4"], images=[img])
    with pytest.raises(ValueError, match=r"prompt 1 has 2 .* placeholder\(s\) but 1 image\(s\) were given for it"):
        processor(text=[f"{ph}", f"{ph} {ph}"], images=[[img], [img]])


def test_qwen_video_is_refused(processors):
    processor = processors["qwen"]
    frames = [picture(32, 32, 11)] * 4
    with pytest.raises(ValueError, match="video inputs need .*torchvision"):
        processor(text=["w3 <|vision_start|><|video_pad|><|vision_end|>"], videos=[frames])
    with pytest.raises(ValueError, match=r"'<\|video_pad\|>'.*torchvision"):
        processor(text=["w3 <|vision_start|><|video_pad|><|vision_end|>"])
    video_turn = [{"role": "user", "content": [{"type": "video", "path": "clip.mp4"}, {"type": "text", "text": "w3"}]}]
    with pytest.raises(ValueError, match="torchvision"):
        processor.apply_chat_template(video_turn, tokenize=True)
