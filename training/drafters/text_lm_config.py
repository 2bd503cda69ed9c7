"""The ``text_lm`` drafter's architecture: a stock Llama LM over the target's tokenizer, and its compute budget.

The issue bounds a text-only drafter at 1/6 of the target LM's compute. Counted as multiply-accumulates per token
in the matmuls (attention projections, gated MLP, LM head), at vocab 985:

    target LM  ("embedded" TargetArch: 8 layers, d384, ffn 1024)   8 * (4*384^2 + 3*384*1024) + 985*384 = 14.53 M
    text_lm    ("embedded" TextLMArch: 2 layers, d256, ffn 1024)   2 * (4*256^2 + 3*256*1024) + 985*256 =  2.35 M

ratio 0.162 (1/6.19). Attention over the context costs 4 * d * layers * L per token: 2048 L vs 12288 L, exactly 1/6
at equal L, and the drafter's context is shorter (144 image tokens per image removed). ``compute_ratio`` computes the
figure and a test pins it under 1/6.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class TextLMArch:
    hidden: int = 256
    layers: int = 2
    heads: int = 4  # head dim 64, as the target's
    kv_heads: int = 4
    ffn: int = 1024
    max_positions: int = 2048

    @classmethod
    def from_name(cls, name: str) -> "TextLMArch":
        if name == "embedded":
            return cls()
        if name == "tiny":  # for tests
            return cls(hidden=32, layers=1, heads=2, kv_heads=2, ffn=64)
        raise ValueError(f"unknown text_lm arch {name!r} (embedded, tiny)")


def matmul_macs_per_token(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """Multiply-accumulates per token in a Llama LM's matmuls (q, k, v, o, gated MLP, LM head), context excluded."""
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    return layers * (attn + 3 * hidden * ffn) + vocab * hidden


def compute_ratio(arch: TextLMArch, target_arch, vocab: int) -> float:
    """text_lm / target-LM matmul compute per token (``target_arch``: a ``zoo.target_config.TargetArch``)."""
    mine = matmul_macs_per_token(arch.hidden, arch.layers, arch.heads, arch.kv_heads, arch.ffn, vocab)
    t = target_arch
    theirs = matmul_macs_per_token(t.lm_hidden, t.lm_layers, t.lm_heads, t.lm_kv_heads, t.lm_ffn, vocab)
    return mine / theirs


def lm_macs_per_token(config) -> int:
    """``matmul_macs_per_token`` of a transformers LM config (a Llama-shaped one: Llama, Qwen2, Mistral, ...)."""
    heads = config.num_attention_heads
    return matmul_macs_per_token(config.hidden_size, config.num_hidden_layers, heads,
                                 getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size,
                                 config.vocab_size)


def build_config(arch: TextLMArch, tokenizer, vocab_size: int | None = None) -> LlamaConfig:
    """``vocab_size``: the LM head's rows (default ``len(tokenizer)``; a user's target: its logits width)."""
    return LlamaConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=arch.hidden, intermediate_size=arch.ffn,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        max_position_embeddings=arch.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def build_model(arch: TextLMArch, tokenizer, seed: int = 0, vocab_size: int | None = None) -> LlamaForCausalLM:
    import torch

    with torch.random.fork_rng():  # seeded init without touching the caller's global RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(build_config(arch, tokenizer, vocab_size))
