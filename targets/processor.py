"""Processors for both target backends, loaded from a local directory without torchvision.

transformers' default image processors (``CLIPImageProcessor``, ``Qwen2VLImageProcessor``) are torchvision classes,
and torchvision cannot be installed beside this torch build. The ``...Pil`` classes do the same resize / crop /
normalise / patchify with PIL + numpy; ``pil_processing.PilProcessorMixin`` always loads those.

- LLaVA (our embedded targets and llava-hf checkpoints such as ``llava-hf/llava-1.5-7b-hf``): ``LlavaPilProcessor`` =
  stock ``LlavaProcessor`` + the mixin. Configs naming ``CLIPImageProcessor`` load as ``CLIPImageProcessorPil``.
- Qwen2.5-VL: ``qwen_processor.Qwen2_5_VLPilProcessor`` = stock ``Qwen2_5_VLProcessor`` without its video processor
  (which needs torchvision) + the mixin.

``load_processor(dir)`` picks the class from the directory (see ``processor_kind``). Saved directories name the stock
classes (``LlavaProcessor``, ``Qwen2_5_VLProcessor``, ``CLIPImageProcessor``, ``Qwen2VLImageProcessor``), so they
stay standard HF checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoProcessor, LlavaProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from .pil_processing import PilProcessorMixin
from .qwen_processor import Qwen2_5_VLPilProcessor

# The world's images are already 168 x 168; these are CLIP's usual statistics.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


class LlavaPilProcessor(PilProcessorMixin, LlavaProcessor):
    """``LlavaProcessor`` with a PIL CLIP image processor, local loading and clear input errors."""

    stock_class = "LlavaProcessor"

    @classmethod
    def _init_defaults(cls, path: str, processor_dict: dict) -> dict:
        # Older llava-hf snapshots have no processor_config.json; without patch_size the stock processor cannot
        # count image tokens. Take it from the model config: CLIP adds one CLS token, "default" drops it again.
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            return {}
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        vision = cfg.get("vision_config") or {}
        out = {}
        if "patch_size" in vision:
            out["patch_size"] = vision["patch_size"]
        if "vision_feature_select_strategy" in cfg:
            out["vision_feature_select_strategy"] = cfg["vision_feature_select_strategy"]
        if vision.get("model_type", "clip_vision_model") == "clip_vision_model":
            out["num_additional_image_tokens"] = 1
        return out


PROCESSORS = {"llava": LlavaPilProcessor, "qwen2_5_vl": Qwen2_5_VLPilProcessor}
_BY_PROCESSOR_CLASS = {"LlavaProcessor": "llava", "Qwen2_5_VLProcessor": "qwen2_5_vl"}


def build_processor(tokenizer, image_size: int = 168, patch_size: int = 14) -> LlavaProcessor:
    """A LlavaProcessor that expands each ``<image>`` into (image_size / patch_size)^2 image tokens."""
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=True,
        do_convert_rgb=True,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    return LlavaPilProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",  # drop CLS: 144 tokens for 168 px / patch 14
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def processor_kind(path: str | Path) -> str | None:
    """"llava" / "qwen2_5_vl" / None for a checkpoint or processor directory.

    ``config.json``'s ``model_type`` first (model checkpoints); otherwise ``processor_class`` from
    ``processor_config.json``, ``preprocessor_config.json`` or ``tokenizer_config.json`` (processor-only
    directories such as the zoo's tokenizer dir).
    """
    path = Path(path)
    model_type = _json(path / "config.json").get("model_type")
    if model_type in PROCESSORS:
        return model_type
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        kind = _BY_PROCESSOR_CLASS.get(_json(path / name).get("processor_class"))
        if kind is not None:
            return kind
    return None


def load_processor(path: str | Path):
    """Load a processor from a local directory: an embedded target / tokenizer dir, a llava-hf checkpoint or a
    Qwen2.5-VL checkpoint, without torchvision. Other model types go to ``AutoProcessor`` (local files only)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"processor {str(path)!r} is not a local directory")
    kind = processor_kind(path)
    if kind is None:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)
    return PROCESSORS[kind].from_pretrained(path)
