"""Tiny random-weight checkpoints in the stock hub layouts of LLaVA-1.5 and Qwen2.5-VL, for tests.

Each builder writes a directory as ``save_pretrained`` writes a hub copy: ``config.json``, ``generation_config.json``,
``model.safetensors``, the tokenizer (``tokenizer.json``, ``tokenizer_config.json``), the chat template
(``chat_template.jinja``) and the processor (``processor_config.json`` / ``preprocessor_config.json``, stock class
names). ``specula.targets.load_target(dir)`` and ``specula.targets.processor.load_processor(dir)`` load them; so does
``specula generate --model dir``.

    build_llava15(dir)    llava-hf/llava-1.5-7b-hf's layout: CLIP tower at 336 px / patch 14 (576 image tokens),
                          vision_feature_layer -2, select strategy "default", GELU projector, a Llama LM; a Llama
                          tokenizer (sentencepiece-style BPE with byte fallback, <s> added in front, <image>, <pad>);
                          the hub chat template ("{system} USER: <image>\\n{text} ASSISTANT:").
    build_qwen25vl(dir)   Qwen/Qwen2.5-VL-7B-Instruct's layout: window-attention ViT (patch 14, window 112, spatial
                          merge 2, one full-attention block), mrope, image_grid_thw; a Qwen2 byte-level BPE with the
                          <|im_start|> ... <|image_pad|> specials; the Qwen2.5-VL chat template (default system
                          "You are a helpful assistant.", <|vision_start|><|image_pad|><|vision_end|> per image).

Widths and depths are tiny (hidden 64, 2 layers; the towers 32 wide, 2 blocks), the geometry is the stock one, so
the token counts a prompt gets are the real checkpoint's. Building one takes about a second; the session fixtures
``llava15_dir`` / ``qwen25vl_dir`` (tests/conftest.py) build each once per test run. Weights are seeded, so two
builds are identical.

The tokenizers are trained here from a few lines of text (``CORPUS``) with the ``tokenizers`` library; unknown
characters fall back to bytes (Llama) or are bytes anyway (Qwen), so any text encodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Long enough to give the BPE real merges; its words are the world's (captions, questions, answers).
CORPUS = [
    "Describe the image. A red circle is to the left of a blue square on a white background.",
    "What colour is the star? Answer with one word. Yellow.",
    "How many triangles are there in the picture? There are three triangles.",
    "Read the sign. The sign says OPEN. What does this chart show? The bars grow from left to right.",
    "You are a helpful assistant. Look at the images in order and describe what changes between them.",
    "A small green triangle sits above a large purple circle, and a grey square is in the corner.",
]

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# llava-hf/llava-1.5-7b-hf's template, written out: a system message is its text and a space; a user or assistant
# message is "ROLE: ", then every image of the message as "<image>\n", then every text part and a space.
LLAVA15_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'] | upper }}: {% endif %}"
    "{% for part in message['content'] if part['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }} {% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# Qwen/Qwen2.5-VL-7B-Instruct's template, written out (ChatML; a default system turn when the first message is
# not one; "Picture n: " labels with add_vision_id).
QWEN25VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]  # Qwen2.5-VL's order


def _bpe(pre_tokenizer, vocab_size: int, alphabet: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a BPE trained on CORPUS (deterministic)."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                        show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(sorted(model["vocab"].items(), key=lambda kv: kv[1])), merges


def llama_tokenizer():
    """Llama's tokenizer layout: <unk> <s> </s>, the 256 byte tokens, the BPE's pieces; <s> in front of every
    encoding; then llava-hf's added <image> and <pad>."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import LlamaTokenizer

    trained, merges = _bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True), 400, [])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in trained:
        vocab.setdefault(piece, len(vocab))
    tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False,
                         legacy=False, add_prefix_space=None)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False),
                    AddedToken("<pad>", special=True, normalized=False)], special_tokens=True)
    tok.pad_token = "<pad>"
    tok.chat_template = LLAVA15_TEMPLATE
    return tok


def qwen2_tokenizer():
    """Qwen2's tokenizer layout: a byte-level BPE, then the specials (no BOS; EOS <|im_end|>, pad <|endoftext|>)."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab, merges = _bpe(byte_level, 500, pre_tokenizers.ByteLevel.alphabet())
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS], special_tokens=True)
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = QWEN25VL_TEMPLATE
    return tok


def build_llava15(out: str | Path) -> Path:
    """A tiny LLaVA-1.5 checkpoint in ``out`` (created); returns it."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from specula.targets.processor import LlavaPilProcessor

    out = Path(out)
    tok = llama_tokenizer()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=336, patch_size=14, projection_dim=32, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=576, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                            do_center_crop=True, do_convert_rgb=True, resample=3,
                                            image_mean=CLIP_MEAN, image_std=CLIP_STD)
    processor = LlavaPilProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=LLAVA15_TEMPLATE)
    processor.save_pretrained(out)
    return out


def build_qwen25vl(out: str | Path) -> Path:
    """A tiny Qwen2.5-VL checkpoint in ``out`` (created); returns it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from specula.targets.qwen_processor import Qwen2_5_VLPilProcessor

    out = Path(out)
    tok = qwen2_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=112, out_hidden_size=64, fullatt_block_indexes=[1],
                  in_channels=3, hidden_act="silu")
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14,
                                               temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
                                               image_std=CLIP_STD)
    processor = Qwen2_5_VLPilProcessor(image_processor=image_processor, tokenizer=tok,
                                       chat_template=QWEN25VL_TEMPLATE)
    processor.save_pretrained(out)
    return out
