"""Int8 drafter weights: the quantized product is within a quantization step of the float one, the lean forward over
them stays close to the stock forward and is rebuilt when the weights change, drafters use them by default on a CPU
(and not when told), and on the shipped drafters they draft what the fp32 weights draft, output unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel

from specula.drafters import create, int8_weights, lean_llama
from specula.targets.kv import growable_cache


def test_quantize_keeps_every_weight_within_half_a_step():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, 48)[:, None]
    q = int8_weights.quantize(w)
    assert q.weight.dtype == torch.int8 and q.weight.shape == (48, 80) and q.scales.shape == (48,)
    assert int(q.weight.abs().max()) <= 127
    scales = q.scales.float()[:, None]  # [N, 1]
    err = (q.weight.float() * scales - w).abs()  # [N, K]
    # half a step, plus the bf16 rounding of the scale itself (relative 2^-8 of the largest weight of the row)
    assert bool((err <= scales / 2 + w.abs().amax(1, keepdim=True) * 2 ** -8 + 1e-7).all())


def test_the_product_is_the_float_product_within_quantization_error():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 96, generator=g), torch.randn(2, 5, 96, generator=g)  # x [B, T, K]
    got = int8_weights.quantize(w)(x)  # [B, T, N]
    want = F.linear(x, w)
    assert got.shape == (2, 5, 64) and got.dtype == torch.float32
    rel = (got - want).norm() / want.norm()
    assert 0 < float(rel) < 0.02  # close, and really quantized (not the float weights)


def test_resolve_chooses_int8_on_a_cpu_only_and_says_what_it_cannot_do(monkeypatch):
    assert int8_weights.resolve("none", "cpu", "t") is False
    assert int8_weights.resolve("auto", "cpu", "t") is int8_weights.kernel_runs("cpu") is True
    assert int8_weights.resolve("int8", "cpu", "t") is True
    assert int8_weights.resolve("auto", "cuda:0", "t") is False  # on a GPU a step is not bound by these bytes
    with pytest.raises(ValueError, match="quantize must be one of"):
        int8_weights.resolve("fp8", "cpu", "t")
    monkeypatch.setattr(int8_weights, "kernel_runs", lambda device_type: False)
    assert int8_weights.resolve("auto", "cpu", "t") is False  # quietly the float weights
    with pytest.raises(ValueError, match="does not run"):
        int8_weights.resolve("int8", "cpu", "t")


def _body(kv_heads: int) -> LlamaModel:
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaModel(cfg).eval()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_int8_forward_stays_close_to_the_stock_forward_step_by_step(kv_heads):
    body = _body(kv_heads)
    cfg = body.config
    stock, lean = growable_cache(cfg), growable_cache(cfg)
    b, s = 2, 0
    with torch.no_grad():
        for t in [6, 1, 3, 1]:  # a prefill, then draft levels
            ids = torch.randint(0, cfg.vocab_size, (b, t))  # [B, T]
            pos = torch.arange(s, s + t).expand(b, t)  # [B, T]
            mask = torch.cat([torch.ones(b, t, s, dtype=torch.bool),
                              torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)], -1)[:, None]
            want = lean_llama.model_forward(body, mask, pos, stock, input_ids=ids)  # [B, T, H] (== stock forward)
            got = lean_llama.model_forward(body, mask, pos, lean, input_ids=ids, int8=True)
            assert got.shape == want.shape
            assert 0 < float((got - want).norm() / want.norm()) < 0.03
            for a, c in zip(stock.layers, lean.layers):
                assert c.keys.shape == a.keys.shape
                assert float((c.keys - a.keys).norm() / a.keys.norm()) < 0.03
            s += t


def test_packed_weights_are_made_once_and_again_when_the_weights_change():
    body = _body(4)
    layer = body.layers[0]
    p = lean_llama.packed(layer)
    assert lean_llama.packed(layer) is p  # kept between steps
    assert p.split == (64, 64, 64) and p.qkv.weight.shape == (192, 64) and p.gate_up.weight.shape == (192, 64)
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(2.0)  # a training step changes a weight in place
    p2 = lean_llama.packed(layer)
    assert p2 is not p
    torch.testing.assert_close(p2.gate_up.scales[96:].float(), 2 * p.gate_up.scales[96:].float(), rtol=1e-2, atol=0)
    layer.self_attn.q_proj.weight = torch.nn.Parameter(torch.zeros_like(layer.self_attn.q_proj.weight))
    assert int(lean_llama.packed(layer).qkv.weight[:64].abs().sum()) == 0  # a replaced weight is read again
    p3 = lean_llama.packed(layer)
    with torch.no_grad():
        layer.input_layernorm.weight.mul_(2.0)  # the norm's weight is folded into q|k|v: made again, scaled
    p4 = lean_llama.packed(layer)
    assert p4 is not p3 and p4.gate_up is not p3.gate_up
    torch.testing.assert_close(p4.qkv.scales[64:].float(), 2 * p3.qkv.scales[64:].float(), rtol=1e-2, atol=0)
    assert "_specula_int8" not in layer.state_dict() and all("int8" not in k for k in body.state_dict())


def test_drafters_quantize_by_default_on_a_cpu_and_not_when_told():
    from transformers import LlamaForCausalLM

    cfg = _body(4).config
    lm = LlamaForCausalLM(cfg).eval()
    assert create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97})._int8 is True
    assert create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97,
                   "quantize": "none"})._int8 is False
    assert create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97, "lean": False,
                   "quantize": "int8"})._int8 is False  # the stock forward has no int8 path
    with pytest.raises(ValueError, match="quantize must be one of"):
        create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97, "quantize": "int4"})


@pytest.fixture(scope="module")
def shipped():
    from specula.runtime.bench.spec import encoded_prompts, load

    _, processor, target, _ = load("target", hf=False)
    return target, processor, encoded_prompts(processor, ["caption", "reasoning"], 2, 0)


@pytest.mark.parametrize("kind", ["text_lm", "massv", "eagle", "flash"])
def test_shipped_drafters_draft_as_well_with_int8_weights_and_the_output_is_unchanged(shipped, kind, monkeypatch):
    """On the embedded target and its trained drafters: greedy output equal to plain decoding with either weights, and
    the int8 drafter's drafts accepted about as often (measured: the same tau on captions). Their heads' products
    (an EAGLE-style head's fc and the target's lm_head it reads; a text LM's own head) go through int8 copies then
    (``int8_weights.linear``), and only then."""
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.engine.loop import SpecEngine
    from specula.runtime.engine.prompts import eos_ids

    products = []
    linear = int8_weights.linear
    monkeypatch.setattr(int8_weights, "linear", lambda m, x: products.append(m) or linear(m, x))
    target, processor, prompts = shipped
    eos = eos_ids(processor.tokenizer, target)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = SpecEngine(target, None, eos_token_ids=eos)
    want = {pid: next(iter(plain.generate([p.request(pid, params)]).values())).tokens for _, pid, p in prompts}
    tau = {}
    for mode in ("none", "int8"):
        d = create({"kind": kind, "quantize": mode}, target=target, tokenizer=processor.tokenizer)
        assert d._int8 is (mode == "int8")
        eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos)
        blocks = tokens = 0
        products.clear()
        for _, pid, p in prompts:
            r = next(iter(eng.generate([p.request(pid, params)]).values()))
            assert r.tokens == want[pid]  # lossless with either weights
            blocks += r.metrics.blocks
            tokens += len(r.tokens)
        tau[mode] = tokens / blocks
        if kind in ("eagle", "flash"):  # the heads' float products went through int8 copies iff int8
            lm_head = target.model.get_output_embeddings()
            assert ({id(m) for m in products} == {id(d.head.fc), id(lm_head)}) is (mode == "int8")
        else:  # the drafter's own LM head, likewise
            head = getattr(d._head, "head", d._head)
            assert ({id(m) for m in products} == {id(head)}) is (mode == "int8")
        layers = list(d._body.layers) if hasattr(d, "_body") else [d.head.layer]  # freshly loaded for this mode
        assert all(hasattr(layer, "_specula_int8") for layer in layers) is (mode == "int8")  # drafted through them
    assert tau["int8"] >= 0.9 * tau["none"], tau


def test_a_layer_the_kernel_does_not_take_keeps_its_float_weights():
    """torch's CPU kernel needs the inner size a multiple of 16 (others crash the process): such a drafter drafts over
    its float weights under "auto" and is refused under "int8", never quantized."""
    from transformers import LlamaForCausalLM

    with pytest.raises(ValueError, match="multiple of 16"):
        int8_weights.quantize(torch.randn(8, 40))
    assert not int8_weights.fits(torch.randn(8, 40)) and int8_weights.fits(torch.randn(8, 48))
    cfg = LlamaConfig(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    lm = LlamaForCausalLM(cfg).eval()
    d = create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97})
    assert d._lean and d._int8 is False
    with pytest.raises(ValueError, match="multiple of 16"):
        create({"kind": "text_lm", "model": lm, "image_token_id": 3, "vocab_size": 97, "quantize": "int8"})


def test_the_caption_member_captions_over_int8_weights_and_says_about_the_same(shipped):
    """The shipped massv model's caption mode over int8 layer weights: made through them, and captions that agree
    with the fp32 ones on most tokens (a caption only shapes the caption member's drafts)."""
    target, processor, prompts = shipped
    model = create({"kind": "massv", "quantize": "none"}, target=target, tokenizer=processor.tokenizer).massv
    pix = [p.pixel_values for _, _, p in prompts if p.pixel_values is not None]
    feats = target.encode_images(torch.cat(pix), model.config.feature).features  # [N_img, T, D]
    fp32 = model.caption(feats, 24)
    assert not any(hasattr(layer, "_specula_int8") for layer in model.lm.model.layers)
    int8 = model.caption(feats, 24, int8=True)
    assert all(hasattr(layer, "_specula_int8") for layer in model.lm.model.layers)
    same = sum(a == b for x, y in zip(fp32, int8) for a, b in zip(x, y))
    assert len(int8) == len(fp32) and same >= 0.8 * sum(len(x) for x in fp32), (fp32, int8)


def test_a_linear_reads_a_kept_int8_copy_made_again_when_its_weight_changes():
    """``int8_weights.linear``: close to the float product (bias included) and really quantized; the copy is kept
    between calls outside the module (the target's lm_head stays as it is) and made again when the weight changes
    in place or is replaced; a weight the kernel does not take is multiplied as it is."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 24)
    keys = set(lin.state_dict())
    x = torch.randn(3, 5, 32)  # [B, T, K]
    with torch.no_grad():
        got, want = int8_weights.linear(lin, x), lin(x)  # [B, T, N]
        assert got.shape == want.shape and 0 < float((got - want).norm() / want.norm()) < 0.02
        held = int8_weights._HELD[lin][1]
        int8_weights.linear(lin, x)
        assert int8_weights._HELD[lin][1] is held  # kept between steps
        assert set(lin.state_dict()) == keys and not [k for k in vars(lin) if "int8" in k or "held" in k]
        lin.weight.mul_(2.0)  # changed in place: a new copy, scaled
        int8_weights.linear(lin, x)
        torch.testing.assert_close(int8_weights._HELD[lin][1].scales.float(), 2 * held.scales.float(), rtol=1e-2,
                                   atol=0)
        lin.weight = torch.nn.Parameter(torch.zeros(24, 32))  # replaced: only the bias is left
        torch.testing.assert_close(int8_weights.linear(lin, x), lin.bias.expand(3, 5, 24))
        odd = torch.nn.Linear(40, 8)
        y = torch.randn(2, 40)
        assert torch.equal(int8_weights.linear(odd, y), odd(y)) and odd not in int8_weights._HELD
