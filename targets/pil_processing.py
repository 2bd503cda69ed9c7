"""What our PIL-only processors share: local loading with the PIL image backend, clear input errors, stock names.

torchvision cannot be installed beside this torch build. transformers 5.23 picks an image processor's backend at load
time (``AutoImageProcessor.from_pretrained(..., backend=...)``): the torchvision class when torchvision imports, the
``...Pil`` class otherwise. We always ask for ``backend="pil"`` so a processor gives the same pixels on every machine,
with or without torchvision.

``PilProcessorMixin`` goes in front of a stock ``ProcessorMixin`` subclass (``LlavaProcessor``,
``Qwen2_5_VLProcessor``) and changes only:

- ``from_pretrained(dir)``: local directories only (``local_files_only=True``, no remote code); the image processor
  comes from ``AutoImageProcessor`` with ``backend="pil"``, the tokenizer from ``AutoTokenizer``; the processor's own
  settings (``processor_config.json``, chat template) through the stock ``get_processor_dict`` /
  ``from_args_and_dict``. Subclasses may fill settings a checkpoint leaves out (``_init_defaults``).
- images: file paths are opened here (URLs are refused: no network), PIL images are decoded up front, anything else
  that is not an image is refused; the number of images must match the image placeholders in the text. All of these
  raise ``ValueError`` naming the image / prompt before any processing.
- saving writes the stock processor class name (``stock_class``), so a saved directory stays a standard HF checkpoint.

Hooks used (transformers 5.23): ``ProcessorMixin.prepare_inputs_layout`` / ``validate_inputs`` (called by
``ProcessorMixin.__call__``), ``get_processor_dict``, ``from_args_and_dict``, ``to_dict``. If a later transformers
stops calling the two input hooks, tests/targets/test_processors.py (the bad-input tests match our messages) fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer
from transformers.image_utils import make_flat_list_of_images

from .image_marks import number_image_marks

IMAGE_TYPES = "a PIL image, a numpy array / torch tensor ([H, W, C] or [C, H, W]) or a local file path"


def _read_image(x, index: int):
    """One image as something the stock image processors take; ValueError if it is not one."""
    if isinstance(x, (str, os.PathLike)):
        where = os.fspath(x)
        if where.startswith(("http://", "https://")):
            raise ValueError(
                f"image {index}: {where!r} is a URL; images are not fetched, pass a local file or a PIL image"
            )
        if not os.path.isfile(where):
            raise ValueError(f"image {index}: {where!r} is not an existing file")
        try:
            with Image.open(where) as im:
                im.load()
                return im
        except Exception as e:  # PIL raises UnidentifiedImageError / OSError / SyntaxError for bad files
            raise ValueError(f"image {index}: cannot read {where!r} as an image ({type(e).__name__}: {e})") from None
    if isinstance(x, Image.Image):
        try:
            x.load()
        except Exception as e:
            raise ValueError(f"image {index}: the PIL image cannot be decoded ({type(e).__name__}: {e})") from None
        return x
    if isinstance(x, (np.ndarray, torch.Tensor)):
        size = x.numel() if isinstance(x, torch.Tensor) else x.size
        if x.ndim not in (2, 3, 4) or size == 0:
            raise ValueError(f"image {index}: an array image must be non-empty 2-D to 4-D, got shape {tuple(x.shape)}")
        return x
    raise ValueError(f"image {index} is a {type(x).__name__}; expected {IMAGE_TYPES}")


def read_images(images):
    """``images`` with every leaf checked / opened, keeping the nesting (one image, a list, or a list per prompt)."""
    count = 0

    def walk(x, depth):
        nonlocal count
        if isinstance(x, (list, tuple)) and depth < 2:
            return [walk(y, depth + 1) for y in x]
        count += 1
        return _read_image(x, count - 1)

    return walk(images, 0)


def check_image_count(text, images, token: str | None) -> None:
    """One image per ``token`` in the text (per prompt when ``images`` is a list of lists, one list per prompt)."""
    if token is None or text is None:
        return
    texts = [text] if isinstance(text, str) else list(text)
    if not all(isinstance(t, str) for t in texts):
        return  # not text: the stock checks say so
    counts = [t.count(token) for t in texts]
    nested = isinstance(images, (list, tuple)) and len(images) > 0 and all(isinstance(i, (list, tuple)) for i in images)
    if nested and len(images) == len(texts):
        for b, (c, imgs) in enumerate(zip(counts, images)):
            if c != len(imgs):
                raise ValueError(
                    f"prompt {b} has {c} {token!r} placeholder(s) but {len(imgs)} image(s) were given for it"
                )
        return
    if images is None or (isinstance(images, (list, tuple)) and len(images) == 0):
        n = 0
    else:
        n = len(make_flat_list_of_images(images))
    if sum(counts) != n:
        where = "the prompt has" if len(texts) == 1 else f"the {len(texts)} prompts have"
        raise ValueError(
            f"{where} {sum(counts)} {token!r} placeholder(s) but {n} image(s) were given; "
            f"put one {token!r} in the text per image, in order"
        )


class PilProcessorMixin:
    """Put in front of a stock processor class; see the module docstring."""

    stock_class: str = ""  # the HF class name written to saved configs, e.g. "LlavaProcessor"
    # Number a set's images in the prompt ("Image n: " before each placeholder; targets/image_marks.py). Saved as
    # ``number_images`` in processor_config.json when on; a stock processor ignores it.
    number_images: bool = False

    @classmethod
    def _init_defaults(cls, path: str, processor_dict: dict) -> dict:
        """Processor settings to use where the checkpoint's processor config leaves them out."""
        return {}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        path = os.fspath(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            raise ValueError(f"processor {path!r} is not a local directory")
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("trust_remote_code is not supported")
        kwargs["local_files_only"] = True
        processor_dict, init_kwargs = cls.get_processor_dict(path, **kwargs)
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        number_images = bool(processor_dict.pop("number_images", False))
        defaults = {k: v for k, v in cls._init_defaults(path, processor_dict).items() if k not in processor_dict}
        processor = cls.from_args_and_dict([image_processor, tokenizer], processor_dict, **{**defaults, **init_kwargs})
        processor.number_images = number_images
        return processor

    def prepare_inputs_layout(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if images is not None:
            images = read_images(images)
        images, text, videos, audio = super().prepare_inputs_layout(images=images, text=text, videos=videos,
                                                                    audio=audio, **kwargs)
        token = getattr(self, "image_token", None)
        if self.number_images and token and isinstance(text, list) and all(isinstance(t, str) for t in text):
            text = [number_image_marks(t, token) for t in text]
        return images, text, videos, audio

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        check_image_count(text, images, getattr(self, "image_token", None))
        super().validate_inputs(images=images, text=text, videos=videos, audio=audio, **kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["processor_class"] = self.stock_class
        if self.number_images:
            out["number_images"] = True
        return out

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        if push_to_hub:
            raise ValueError("push_to_hub is not supported; save locally and upload yourself")
        files = super().save_pretrained(save_directory, **kwargs)
        # The stock save stamps our subclass name into tokenizer_config.json; put the stock name back.
        tok_cfg = Path(save_directory) / "tokenizer_config.json"
        if tok_cfg.is_file():
            cfg = json.loads(tok_cfg.read_text(encoding="utf-8"))
            if cfg.get("processor_class") == type(self).__name__:
                cfg["processor_class"] = self.stock_class
                tok_cfg.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return files
