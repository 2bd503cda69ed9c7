"""The lean drafting forward computes what the stock HF Llama forward computes: hidden states and caches, with custom
4-D masks, batches, GQA; it refuses what it does not cover; and the drafters really draft through it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specula.drafters import DraftContext, Verdict, create, lean_llama
from specula.targets.kv import growable_cache
from specula.training.drafters.text_lm_config import TextLMArch, build_config


def _config(kv_heads: int = 4, attn: str = "sdpa", **kw) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=256, **kw)
    cfg._attn_implementation = attn
    return cfg


def _masks(b: int, s: int, t: int, seed: int) -> torch.Tensor:
    """[B, 1, T, S + T] bool: random holes in the cached part, causal over the new part, self always allowed."""
    g = torch.Generator().manual_seed(seed)
    cached = torch.rand(b, t, s, generator=g) > 0.3  # [B, T, S]
    new = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)  # [B, T, T]
    return torch.cat([cached, new], dim=-1)[:, None]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("growable", [False, True])
def test_model_forward_matches_the_stock_forward_step_by_step(kv_heads, growable):
    torch.manual_seed(0)
    cfg = _config(kv_heads)
    body = LlamaModel(cfg).eval()
    stock, lean = [growable_cache(cfg) if growable else DynamicCache(config=cfg) for _ in range(2)]
    b, s = 3, 0
    with torch.no_grad():
        for step, t in enumerate([7, 1, 3, 1, 2]):  # a prefill, then draft levels / tails of several widths
            ids = torch.randint(0, cfg.vocab_size, (b, t))  # [B, T]
            pos = torch.arange(s, s + t).expand(b, t) + torch.tensor([[0], [2], [5]])  # [B, T], per-row offsets
            mask = _masks(b, s, t, step)  # [B, 1, T, S + T]
            want = body(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=stock,
                        use_cache=True).last_hidden_state
            got = lean_llama.model_forward(body, mask, pos, lean, input_ids=ids)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            for a, c in zip(stock.layers, lean.layers):
                torch.testing.assert_close(c.keys, a.keys, rtol=0, atol=1e-6)
                torch.testing.assert_close(c.values, a.values, rtol=0, atol=1e-6)
            s += t


def test_layer_step_matches_the_stock_layer_and_refuses_what_it_does_not_cover():
    torch.manual_seed(1)
    cfg = _config(2)
    layer, rotary = LlamaDecoderLayer(cfg, layer_idx=0).eval(), LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 5, cfg.hidden_size)  # [B, T, H]
    pos = torch.arange(5).expand(2, 5)
    mask = _masks(2, 0, 5, 3)
    stock, lean = DynamicCache(config=cfg), DynamicCache(config=cfg)
    with torch.no_grad():
        want = layer(x, attention_mask=mask, position_ids=pos, past_key_values=stock, use_cache=True,
                     position_embeddings=rotary(x, pos))
        got = lean_llama.layer_step(layer, rotary, x, mask, pos, lean)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(lean.layers[0].keys, stock.layers[0].keys, rtol=0, atol=1e-6)
        assert lean_llama.layer_step(layer, rotary, x, None, pos, lean) is None  # no mask: plain causal, stock path
        assert lean_llama.layer_step(layer, rotary, x, mask, pos, None) is None  # no cache: training shapes
        assert lean_llama.layer_step(layer, rotary, x, mask.float(), pos, lean) is None  # additive (eager) mask
    assert lean_llama.layer_step(layer, rotary, x, mask, pos, lean) is None  # grad enabled: training


def test_supported_only_for_what_the_lean_path_computes():
    assert lean_llama.supported(_config())
    assert not lean_llama.supported(_config(attn="eager"))
    assert not lean_llama.supported(_config(attention_bias=True))
    assert not lean_llama.supported(_config(mlp_bias=True))
    assert not lean_llama.supported(_config(hidden_act="gelu"))
    scaled = _config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert not lean_llama.supported(scaled)


def test_text_lm_drafts_through_the_lean_path_with_the_stock_paths_drafts():
    """The same requests drafted by two text_lm drafters over one model, one forced onto the stock forward: the
    same tokens and the same q, block after block (and the lean one never calls the HF module)."""
    class _Tok:
        def __len__(self):
            return 97

        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    torch.manual_seed(2)
    model = LlamaForCausalLM(build_config(TextLMArch.from_name("tiny"), _Tok())).eval()
    model.config._attn_implementation = "sdpa"
    lean = create({"kind": "text_lm", "model": model, "image_token_id": 96, "quantize": "none"})
    stock = create({"kind": "text_lm", "model": model, "image_token_id": 96, "lean": False})
    assert lean._lean and not stock._lean
    with pytest.raises(ValueError, match="lean must be true or false"):
        create({"kind": "text_lm", "model": model, "image_token_id": 96, "lean": "yes"})
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *a, **k: calls.append(1), with_kwargs=True)
    g = torch.Generator().manual_seed(3)
    ctx = [DraftContext(f"r{i}", torch.randint(3, 90, (5 + 3 * i,), generator=g), 7, temperature=t, seed=i)
           for i, t in enumerate([0.0, 1.0])]
    try:
        for d in (lean, stock):
            d.begin(ctx)
        for _ in range(4):
            calls.clear()
            a = lean.propose(["r0", "r1"], gamma=4)
            lean_calls = len(calls)
            b = stock.propose(["r0", "r1"], gamma=4)
            assert lean_calls == 0 and len(calls) > 0
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.q, b.q, rtol=0, atol=1e-6)
            verdicts = [Verdict(f"r{i}", (0, 1), tuple(int(x) for x in a.tokens[i, :2]), 11) for i in range(2)]
            for d in (lean, stock):
                d.observe(verdicts)
    finally:
        hook.remove()


def test_rope_tables_are_bit_for_bit_the_direct_computation():
    """The per-position table (CPU) gives exactly what computing each position gives (the path off the CPU), as the
    table grows past its first size and after the rotary's frequencies change."""
    rotary = LlamaRotaryEmbedding(_config())
    g = torch.Generator().manual_seed(0)
    for top in (10, 300, 1000):
        pos = torch.randint(0, top, (3, 5), generator=g)  # [B, T]
        for a, b in zip(lean_llama.rope_tables(rotary, pos, torch.float32),
                        lean_llama._rope_direct(rotary, pos, torch.float32)):
            assert a.shape == (3, 1, 5, 16) and torch.equal(a, b)
    rotary.inv_freq.mul_(0.5)  # in place: the table must be rebuilt
    pos = torch.arange(7)[None]
    for a, b in zip(lean_llama.rope_tables(rotary, pos, torch.float32),
                    lean_llama._rope_direct(rotary, pos, torch.float32)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["text_lm", "flash", "aasd"])
def test_every_drafter_cache_appends_in_place(kind):
    """The drafters' KV caches are ``GrowableLayer``s: a draft step writes its slots into spare room instead of
    copying the whole cache (HF's stock layer concatenates)."""
    from specula.runtime.bench.spec import make_drafter
    from specula.targets import load_target
    from specula.targets.kv import GrowableLayer
    from specula.zoo.store import resolve

    d = make_drafter({"kind": kind}, load_target(resolve("target")))  # the shipped weights
    layers = d._kv.new_cache().layers
    assert layers and all(type(layer) is GrowableLayer for layer in layers)
