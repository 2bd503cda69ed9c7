"""Numbered image sets: the text rewrite, and a processor with ``number_images`` on (saved, loaded, applied)."""

import json

import pytest
from PIL import Image

from specula.targets.image_marks import number_image_marks
from specula.targets.processor import load_processor
from specula.zoo.store import TARGET_DIR, TOKENIZER_DIR


def test_bare_sets_get_their_numbers_and_marked_ones_stay():
    assert number_image_marks("<image><image><image> Which?") == \
        "Image 1: <image> Image 2: <image> Image 3: <image> Which?"
    marked = "Image 1: <image> Image 2: <image> What colour is it?"
    assert number_image_marks(marked) == marked
    assert number_image_marks("<|user|>\n<image><image>\nQ") == "<|user|>\nImage 1: <image> Image 2: <image>\nQ"
    assert number_image_marks("Image 1: <image><image> Q") == "Image 1: <image> Image 2: <image> Q"  # half marked
    for one in ("<image> What shape?", "<|user|>\n<image>\nQ", "no images"):
        assert number_image_marks(one) == one
    assert number_image_marks("<img><img>", "<img>") == "Image 1: <img> Image 2: <img>"


@pytest.fixture(scope="module")
def images():
    return [Image.new("RGB", (168, 168), c) for c in ("red", "blue")]


def test_the_processor_numbers_sets_only_when_asked(images, tmp_path):
    proc = load_processor(TOKENIZER_DIR)
    assert not proc.number_images  # the tokenizer's processor: prompts as written
    if (TARGET_DIR / "processor_config.json").exists():  # the shipped target's: as the recipe's stage trained it
        from specula.training.recipe import SHIPPED_UNTIL, stages_until

        trained = stages_until(SHIPPED_UNTIL)[-1].config.get("number_images", False)
        assert bool(load_processor(TARGET_DIR).number_images) == trained
    bare = proc(text=["<image><image> Q"], images=images, return_tensors="pt").input_ids
    marked = proc(text=["Image 1: <image> Image 2: <image> Q"], images=images, return_tensors="pt").input_ids
    assert bare.shape[1] < marked.shape[1]
    proc.number_images = True
    numbered = proc(text=["<image><image> Q"], images=images, return_tensors="pt").input_ids
    assert numbered.tolist() == marked.tolist()
    one = proc(text=["<image> Q"], images=images[:1], return_tensors="pt").input_ids
    proc.number_images = False
    assert one.tolist() == proc(text=["<image> Q"], images=images[:1], return_tensors="pt").input_ids.tolist()


def test_the_setting_is_saved_and_loaded(images, tmp_path):
    proc = load_processor(TOKENIZER_DIR)
    proc.save_pretrained(tmp_path / "off")
    assert "number_images" not in json.loads((tmp_path / "off" / "processor_config.json").read_text())
    proc.number_images = True
    proc.save_pretrained(tmp_path / "on")
    assert json.loads((tmp_path / "on" / "processor_config.json").read_text())["number_images"] is True
    back = load_processor(tmp_path / "on")
    assert back.number_images and not load_processor(tmp_path / "off").number_images
    ids = back(text=["<image><image> Q"], images=images, return_tensors="pt").input_ids
    assert back.tokenizer.convert_ids_to_tokens(ids[0, :3].tolist()) == ["▁Image", "▁1", ":"]
    with pytest.raises(ValueError, match="placeholder"):  # the count check still comes first
        back(text=["<image><image> Q"], images=images[:1], return_tensors="pt")
