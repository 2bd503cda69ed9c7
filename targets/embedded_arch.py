"""The embedded target's architecture: a stock LLaVA (CLIP vision tower + MLP projector + Llama LM) from configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration


@dataclass(frozen=True)
class TargetArch:
    """Sizes chosen by measurement on the 2-core CPU (see docs/embedded-model.md, "The target")."""

    image_size: int = 168
    patch_size: int = 14  # -> 12 x 12 = 144 visual tokens per image
    vision_hidden: int = 256
    vision_layers: int = 4
    vision_heads: int = 4
    lm_hidden: int = 384
    lm_layers: int = 8
    lm_heads: int = 6
    lm_kv_heads: int = 6
    lm_ffn: int = 1024
    max_positions: int = 2048

    @classmethod
    def from_name(cls, name: str) -> "TargetArch":
        if name == "embedded":
            return cls()
        if name == "tiny":  # for tests: same shape of model, a fraction of the cost
            return cls(vision_hidden=64, vision_layers=1, vision_heads=2, lm_hidden=64, lm_layers=2, lm_heads=2,
                       lm_kv_heads=2, lm_ffn=128)
        if name == "tiny_deep":  # for tests of losses on deeper layers and other heads (training/target/set_referents.py)
            return dataclasses.replace(cls.from_name("tiny"), lm_layers=6, lm_heads=4, lm_kv_heads=4)
        raise ValueError(f"unknown target arch {name!r} (embedded, tiny, tiny_deep)")


def build_config(arch: TargetArch, tokenizer) -> LlavaConfig:
    vision = CLIPVisionConfig(
        hidden_size=arch.vision_hidden, intermediate_size=4 * arch.vision_hidden, num_hidden_layers=arch.vision_layers,
        num_attention_heads=arch.vision_heads, image_size=arch.image_size, patch_size=arch.patch_size,
        hidden_act="gelu", projection_dim=arch.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=arch.lm_hidden, intermediate_size=arch.lm_ffn,
        num_hidden_layers=arch.lm_layers, num_attention_heads=arch.lm_heads, num_key_value_heads=arch.lm_kv_heads,
        max_position_embeddings=arch.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    n_tokens = (arch.image_size // arch.patch_size) ** 2
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu", vision_feature_select_strategy="default", vision_feature_layer=-1,
        image_seq_length=n_tokens, tie_word_embeddings=True,
    )


def build_model(arch: TargetArch, tokenizer, seed: int = 0) -> LlavaForConditionalGeneration:
    import torch

    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(build_config(arch, tokenizer))
