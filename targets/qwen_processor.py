"""Qwen2.5-VL processor without torchvision: stock ``Qwen2_5_VLProcessor`` minus its video processor.

The stock processor has three parts (image processor, tokenizer, video processor). Its video processor,
``Qwen2VLVideoProcessor``, exists only with a torchvision backend, so ``AutoProcessor.from_pretrained`` on a
Qwen2.5-VL directory raises ``ImportError: Qwen2VLVideoProcessor requires the Torchvision library`` (transformers 5.23)
even for image-only use. This subclass drops the video part from ``__init__`` (ProcessorMixin derives its parts from
the ``__init__`` signature) and loads ``Qwen2VLImageProcessorPil`` for images (see ``pil_processing``). Everything
else (image-token expansion ``<|image_pad|>`` x ``image_grid_thw.prod() / merge_size**2``, ``mm_token_type_ids``,
chat template, decoding) is the stock code.

Videos raise ``ValueError``: Qwen's video path (2 frames per temporal patch, ``second_per_grid_ts``) is not the same
as frames passed as separate images, so there is no cheap stand-in.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin

from .pil_processing import PilProcessorMixin

VIDEO_UNSUPPORTED = (
    "video inputs need Qwen2VLVideoProcessor, which needs torchvision (not installed here); "
    "this processor takes images only"
)


def _has_video(conversation) -> bool:
    if isinstance(conversation, dict):
        if str(conversation.get("type", "")).startswith("video"):
            return True
        return any(_has_video(v) for v in conversation.values() if isinstance(v, (list, dict)))
    if isinstance(conversation, (list, tuple)):
        return any(_has_video(v) for v in conversation)
    return False


class Qwen2_5_VLPilProcessor(PilProcessorMixin, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with a PIL image processor and no video processor."""

    stock_class = "Qwen2_5_VLProcessor"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # Same token setup as Qwen2_5_VLProcessor.__init__; the parts are (image_processor, tokenizer) only.
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token
        )
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token
        )
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if videos is not None:
            raise ValueError(VIDEO_UNSUPPORTED)
        texts = [text] if isinstance(text, str) else (text or [])
        if any(isinstance(t, str) and self.video_token in t for t in texts):
            raise ValueError(f"the text contains {self.video_token!r}: {VIDEO_UNSUPPORTED}")
        super().validate_inputs(images=images, text=text, videos=None, audio=audio, **kwargs)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        if _has_video(conversation):
            raise ValueError(VIDEO_UNSUPPORTED)
        return super().apply_chat_template(conversation, chat_template=chat_template, **kwargs)

    def _get_num_multimodal_tokens(self, image_sizes=None, video_sizes=None, **kwargs):
        if video_sizes is not None:
            raise ValueError(VIDEO_UNSUPPORTED)
        return super()._get_num_multimodal_tokens(image_sizes=image_sizes, **kwargs)
