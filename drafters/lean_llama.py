"""A lean inference forward over stock HF Llama decoder layers, for the drafters' hot loop.

A drafter step is one to three tiny decoder layers over one or a few tokens. Through ``LlamaModel.forward`` such a
step spends most of its time outside the matmuls: module ``__call__`` hooks, kwargs plumbing, config lookups, mask
preparation (``create_causal_mask``) and the attention-interface dispatch. Measured on the shipped ``text_lm`` (2
layers, d256, 1 token, cache of 400, 1 thread): 1.55 ms per HF step against 0.41 ms for its matmuls alone.

These functions compute the same math, op for op in HF's order (RMSNorm in fp32, RoPE as ``(x * cos) +
(rotate_half(x) * sin)``, SDPA with the caller's 4-D mask and the module's scaling, SiLU-gated MLP), reading the
weights of the stock modules in place, so a drafter keeps its HF model (training, ``save_pretrained``, state dicts)
and only its no-grad drafting calls go through here. The K/V of each layer go through the HF cache's own
``update`` (``DynamicCache`` / ``targets.kv.GrowableLayer``), so ``targets.kv.BatchedKV`` bookkeeping is
unchanged. Tests check outputs and caches against the stock forward (``tests/drafters/test_lean_llama.py``).

Only what the drafters use is supported: ``sdpa`` attention with a boolean 4-D mask (True = attend), default RoPE
(no scaling), no attention / MLP bias. ``supported(config)`` says whether a config qualifies; callers fall back to
the stock forward otherwise.

``int8=True`` (a drafter's ``quantize`` option, ``drafters/int8_weights.py``) runs the same step over int8 copies
of the weights, fused per layer (q|k|v in one product, gate|up in one, each with the RMSNorm weight before it
folded in), made once and rebuilt when the module's weights change (``packed``): a quarter of the bytes a
memory-bound step reads and fewer ops per step, no longer the stock math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specula.drafters import int8_weights
from specula.drafters.int8_weights import Int8Weight, quantize


def supported(config) -> bool:
    """Whether the lean forward computes exactly what the stock forward does for this ``LlamaConfig``."""
    rope = getattr(config, "rope_parameters", None) or {}
    return (getattr(config, "_attn_implementation", None) == "sdpa"
            and rope.get("rope_type", "default") == "default"
            and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
            and getattr(config, "hidden_act", "silu") == "silu")


def rope_cos_sin(rotary, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRotaryEmbedding`` without its decorators: pos [B, T] int64 -> cos, sin [B, T, D] in ``dtype``."""
    freqs = pos[..., None].float() * rotary.inv_freq.to(device=pos.device, dtype=torch.float)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    scale = rotary.attention_scaling
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_tables(rotary, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` read from a table of every position up to the largest asked (kept on ``rotary``, grown on
    demand, rebuilt when ``inv_freq`` or the dtype changes): pos [B, T] -> cos, signed sin [B, 1, T, D].

    The signed sin is sin with its first half negated, so ``_rotate`` needs no negation: ``rotate_half(x) * sin ==
    roll(x, D/2) * signed_sin`` exactly (IEEE negation commutes with the product). The table's entries are the
    values ``rope_cos_sin`` computes for the same position, bit for bit (the same ops on the same fp32 inputs).
    Off the CPU the table is not used (sizing it reads the largest position on the host: a device sync per step)."""
    if pos.device.type != "cpu":
        return _rope_direct(rotary, pos, dtype)
    key = (rotary.inv_freq.data_ptr(), rotary.inv_freq._version, dtype, pos.device)
    held = getattr(rotary, "_specula_rope", None)
    if held is not None and held[0] == key:
        try:  # the table covers these positions (no host read of their largest: an index past it raises)
            return held[1][pos][:, None], held[2][pos][:, None]  # [B, 1, T, D]
        except IndexError:
            pass
    need = int(pos.max()) + 1 if pos.numel() else 1
    if held is None or held[0] != key or held[1].shape[0] < need:
        size = max(need, 2 * held[1].shape[0] if held is not None and held[0] == key else 256)
        cos, signed = _rope_direct(rotary, torch.arange(size, device=pos.device)[None], dtype)  # [1, 1, N, D]
        held = (key, cos[0, 0], signed[0, 0])
        rotary._specula_rope = held  # a plain attribute: not a buffer, never saved
    return held[1][pos][:, None], held[2][pos][:, None]  # [B, 1, T, D]


def _rope_direct(rotary, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables``' result computed for ``pos`` alone: cos, signed sin [B, 1, T, D]."""
    cos, sin = rope_cos_sin(rotary, pos, dtype)  # [B, T, D]
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``: x [..., H]. In fp32, torch's one-op ``rms_norm`` computes exactly that (the same
    fp32 ops; tests compare against the stock module); other dtypes go HF's way (normalise in fp32, round, scale)."""
    dtype, weight = x.dtype, norm._parameters["weight"]
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, norm.variance_epsilon)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos / signed_sin [B, 1, T, D] (``rope_tables``) -> HF's ``(x * cos) + (rotate_half(x) *
    sin)``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


@dataclass(frozen=True)
class PackedLayer:
    """A decoder layer's weights as int8, fused: ``qkv`` [nh*D + 2*nkv*D, H], ``o`` [H, nh*D], ``gate_up``
    [2*I, H], ``down`` [H, I]; ``split`` = (nh*D, nkv*D, nkv*D), the widths of q, k, v in ``qkv``'s output."""

    qkv: Int8Weight
    o: Int8Weight
    gate_up: Int8Weight
    down: Int8Weight
    split: tuple[int, int, int]
    floors: tuple[float, float]  # sqrt(H * eps) of the input and post-attention norms (``_unit``)


def _weights(layer) -> tuple:
    """The layer's seven linear weights, read from the modules' own tables (``nn.Module.__getattr__`` costs a Python
    call per name, and ``packed`` reads these at every step)."""
    mods = layer._modules
    attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
    return tuple(m._parameters["weight"] for m in (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"],
                                                  mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]))


def _norm_weights(layer) -> tuple:
    mods = layer._modules
    return mods["input_layernorm"]._parameters["weight"], mods["post_attention_layernorm"]._parameters["weight"]


def _unit(x: torch.Tensor, floor: float) -> torch.Tensor:
    """x [..., H] over its norm (at least ``floor``): an RMSNorm without its weight and its sqrt(H), which ``packed``
    folds into the next product's columns. RMSNorm divides by sqrt(mean(x^2) + eps) = |x| sqrt(1 + H eps / |x|^2)
    / sqrt(H): this drops the eps term's 1 + H eps / (2 |x|^2), well under the int8 weights' rounding for any
    hidden state a layer sees, and takes one reduction where torch's ``rms_norm`` takes five ops."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(floor)


def int8_drafting(quantize_mode: str, device, layers, who: str) -> bool:
    """Whether a drafter drafts these decoder layers over int8 weights: ``int8_weights.resolve`` for the mode and
    device, and every weight of the layers one the kernel takes (``int8_weights.fits``); "int8" asked for layers it
    does not take is an error, "auto" quietly keeps the float weights."""
    if not int8_weights.resolve(quantize_mode, device, who):
        return False
    odd = _odd_shapes(layers)
    if odd and quantize_mode == "int8":
        raise ValueError(f"{who}: quantize 'int8' needs every layer weight's input size to be a multiple of "
                         f"{int8_weights.K_MULTIPLE}; got {odd[0]}; use 'none'")
    return not odd


def int8_fits(layers) -> bool:
    """Whether every weight of these decoder layers is one the int8 kernel takes."""
    return not _odd_shapes(layers)


def _odd_shapes(layers) -> list[tuple[int, ...]]:
    return [tuple(w.shape) for layer in layers for w in _weights(layer) if not int8_weights.fits(w)]


def packed(layer) -> PackedLayer:
    """``layer``'s int8 weights, made on first use and kept on the module (a plain attribute: never saved), made
    again when a weight (the norms' included) is replaced, moved or changed in place (training steps bump
    ``_version``). Each RMSNorm's weight, times sqrt(H), is folded into the columns of the product that reads the
    norm's output (q|k|v, gate|up), so a step normalizes with ``_unit`` alone."""
    ws = _weights(layer) + _norm_weights(layer)
    key = tuple((w.data_ptr(), w._version) for w in ws)
    held = getattr(layer, "_specula_int8", None)
    if held is None or held[0] != key:
        q, k, v, o, gate, up, down, w_in, w_post = ws
        mods = layer._modules
        n_in, n_post = mods["input_layernorm"], mods["post_attention_layernorm"]
        h = w_in.shape[0]
        fold_in = w_in.detach().float()[None, :] * h ** 0.5  # [1, H]
        fold_post = w_post.detach().float()[None, :] * h ** 0.5  # [1, H]
        held = (key, PackedLayer(quantize(torch.cat([q, k, v]).float() * fold_in), quantize(o),
                                 quantize(torch.cat([gate, up]).float() * fold_post), quantize(down),
                                 (q.shape[0], k.shape[0], v.shape[0]),
                                 ((h * n_in.variance_epsilon) ** 0.5, (h * n_post.variance_epsilon) ** 0.5)))
        layer._specula_int8 = held
    return held[1]


def decoder_layer(layer, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache, layer_idx: int, int8: bool = False) -> torch.Tensor:
    """One ``LlamaDecoderLayer`` step (``int8``: ``_int8_step`` over ``packed(layer)``).

    x     # [B, T, H]
    mask  # [B, 1, T, S + T] bool, True = attend (S: slots already in ``cache`` for this layer)
    cos, sin  # [B, 1, T, D] from ``rope_tables`` (sin signed)
    cache: an HF ``Cache`` (its ``update(k, v, layer_idx)`` appends and returns the whole K/V) or None.
    """
    if int8:
        return _int8_step(layer.self_attn, packed(layer), x, mask, cos, sin, cache, layer_idx)
    attn, mlp = layer.self_attn, layer.mlp
    b, t, _ = x.shape
    d = attn.head_dim
    h = rms_norm(layer.input_layernorm, x)  # [B, T, H]
    q, k, v = F.linear(h, attn.q_proj.weight), F.linear(h, attn.k_proj.weight), F.linear(h, attn.v_proj.weight)
    q = q.reshape(b, t, -1, d).transpose(1, 2)  # [B, nh, T, D]
    k = k.reshape(b, t, -1, d).transpose(1, 2)  # [B, nkv, T, D]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    v = v.reshape(b, t, -1, d).transpose(1, 2)  # [B, nkv, T, D]
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)  # [B, nkv, S + T, D]
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=gqa)  # [B, nh, T, D]
    o = o.transpose(1, 2).reshape(b, t, -1)  # [B, T, nh * D]
    x = x + F.linear(o, attn.o_proj.weight)
    h = rms_norm(layer.post_attention_layernorm, x)  # [B, T, H]
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def _int8_step(attn, p: PackedLayer, x: torch.Tensor, mask, cos, sin, cache, layer_idx: int) -> torch.Tensor:
    """``decoder_layer`` over int8 weights, with as few ops as the math allows (a drafter step is bound by their
    count): the rows as one [B*T, H] matrix, the kernel called directly on bf16 input, its bf16 output left to
    type promotion where an fp32 op reads it (the rotation, the residual adds), gate|up's SiLU product in bf16 (the
    down product reads bf16 anyway). The residual stream, RoPE, the attention and the cache stay fp32.
    x [B, T, H] fp32 -> [B, T, H] fp32."""
    b, t, width = x.shape
    d = attn.head_dim
    mm, bf16 = torch._weight_int8pack_mm, torch.bfloat16
    x2 = x.reshape(b * t, width)  # [M, H]
    y = mm(_unit(x2, p.floors[0]).to(bf16), p.qkv.weight, p.qkv.scales)  # [M, (nh + 2 nkv) D] bf16
    nqk = p.split[0] + p.split[1]
    qk = _rotate(y[:, :nqk].view(b, t, -1, d).transpose(1, 2), cos, sin)  # [B, nh + nkv, T, D] fp32
    q, k = qk.split((p.split[0] // d, p.split[1] // d), dim=1)  # [B, nh, T, D], [B, nkv, T, D]
    v = y[:, nqk:].view(b, t, -1, d).transpose(1, 2).float()  # [B, nkv, T, D]
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)  # [B, nkv, S + T, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                       enable_gqa=q.shape[1] != k.shape[1])  # [B, nh, T, D]
    x2 = x2 + mm(o.transpose(1, 2).reshape(b * t, -1).to(bf16), p.o.weight, p.o.scales)  # [M, H] fp32
    gate, up = mm(_unit(x2, p.floors[1]).to(bf16), p.gate_up.weight, p.gate_up.scales).chunk(2, dim=-1)  # [M, I]
    return (x2 + mm(F.silu(gate) * up, p.down.weight, p.down.scales)).view(b, t, width)


def model_forward(body, mask: torch.Tensor, pos: torch.Tensor, cache, input_ids: torch.Tensor | None = None,
                  inputs_embeds: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """``LlamaModel`` (``body``) with a boolean 4-D mask -> final-normed hidden states [B, T, H].

    input_ids [B, T] or inputs_embeds [B, T, H]; mask [B, 1, T, S + T] bool (None: every token attends every slot,
    right for one new token per row); pos [B, T] int64; cache: HF Cache; ``int8``: over ``packed`` weights.
    """
    x = body.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, H]
    cos, sin = rope_tables(body.rotary_emb, pos, x.dtype)
    n = body.config.num_hidden_layers
    for i, layer in enumerate(body.layers._modules.values()):  # (slicing a ModuleList builds a new module per call)
        if i == n:
            break
        x = decoder_layer(layer, x, mask, cos, sin, cache, i, int8)
    return rms_norm(body.norm, x)


def layer_step(layer, rotary, x: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor,
               cache, int8: bool = False) -> torch.Tensor | None:
    """One decoder layer with its own rotary embedding (the feature heads: eagle, msd, flash, aasd) through the lean
    path when it applies: no grad, a cache to append to (layer 0), a boolean mask and a ``supported`` config.
    Returns [B, T, H], or None when the caller must run the stock layer (training, eager attention, no mask)."""
    if torch.is_grad_enabled() or cache is None or mask is None or mask.dtype != torch.bool or not _lean_ok(layer):
        return None
    cos, sin = rope_tables(rotary, pos, x.dtype)
    return decoder_layer(layer, x, mask, cos, sin, cache, layer.self_attn.layer_idx, int8)


def _lean_ok(layer) -> bool:
    """``supported`` for the layer's config, kept on the layer (a plain attribute, never saved) while the layer
    keeps that config object: reading an HF config's fields costs microseconds each, at every step."""
    cfg = layer.self_attn.config
    held = getattr(layer, "_specula_lean", None)
    if held is None or held[0] is not cfg:
        held = (cfg, supported(cfg))
        layer._specula_lean = held
    return held[1]
