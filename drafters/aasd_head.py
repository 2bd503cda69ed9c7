"""The AASD draft model (Yang et al.): one decoder layer that attends the target's own last-layer KV cache.

    x_t = e(x_t)                                  the target's frozen input embedding of the token at position t
    q'_t, k'_t, v'_t = proj(RMSNorm(x_t))         at position t (RoPE), the target's head layout (H_kv, D)
    o_t = attention(q'_t, [K_ctx ; K'_{s..t}], [V_ctx ; V'_{s..t}])   eq. 4-5: the target's last-layer keys and
                                                                     values of the committed context (before s, the
                                                                     chain's start), then the draft's own from s on
    h^_t = RMSNorm(x_t + o_t + MLP(..))           the rest of a Llama decoder layer, then a final norm
    q(x_{t+1}) = softmax(lm_head(h^_t) / T)       the target's frozen lm_head

K_ctx is the target's cache as it is for text, and for each image its T_img entries compressed by the KV
projector (eq. 3): K*_I = W_K K_I, V*_I = W_V V_I with W_K, W_V [k, T_img] (k = ``kv_tokens``, 64 by default),
shared by all heads and applied to the cached (post-RoPE) keys as they are.

Choices the paper leaves open, made here:
- The draft model is one Llama decoder layer of the target's shape (so its queries and keys live in the space of
  the target's last layer and GQA heads line up) plus a final RMSNorm; ``init_from_target`` copies the target's
  last decoder layer and final norm into it before training: at the start the draft is "the target's last layer
  fed with token embeddings instead of layer L-1's states". Its input is the token embedding alone (the paper's
  M_D receives x_i); it reads no hidden state.
- W_K / W_V start as contiguous average pooling (k groups of the row-major token order); a run of several images
  is compressed image by image. ``image_tokens`` is the target's fixed count per image (LLaVA); on a target
  whose images vary in size (Qwen2.5-VL, ``image_tokens`` None) each image is average-pooled to min(k, T_img)
  entries, W's initial form, since one learned [k, T_img] matrix cannot take every size.
- Positions are sequence indices (LLaVA's). The compressed entries carry the rotations of the keys they mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specula.drafters import int8_weights, lean_llama
from specula.drafters.eagle_head import EagleConfig, _load_head


@dataclass(frozen=True)
class AasdConfig(EagleConfig):
    kv_tokens: int = 64  # k: compressed KV entries per image
    image_tokens: int | None = None  # T_img of the target (fixed per image); None: any size (Qwen2.5-VL), pooled
    attention_bias: bool = False  # q/k/v (and o) projections with a bias, as the target's (Qwen2's q/k/v have one)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.kv_tokens, bool) or not isinstance(self.kv_tokens, int) or self.kv_tokens < 1:
            raise ValueError(f"AasdConfig.kv_tokens must be an integer >= 1, got {self.kv_tokens!r}")
        t = self.image_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"AasdConfig.image_tokens must be an integer >= 1 or None, got {t!r}")

    @classmethod
    def from_target(cls, target, **overrides) -> AasdConfig:
        base = EagleConfig.from_target(target)
        model = target.model if hasattr(target, "info") else target
        t = getattr(model.config, "image_seq_length", None)
        last = model.model.language_model.layers[-1].self_attn
        return cls(**{**base.__dict__, "image_tokens": None if t is None else int(t),
                      "attention_bias": last.q_proj.bias is not None, **overrides})

    def llama_config(self, attn_implementation: str = "sdpa"):
        cfg = super().llama_config(attn_implementation)
        cfg.attention_bias = self.attention_bias
        return cfg


class AasdHead(nn.Module):
    """One decoder layer + final norm over token embeddings, attending a given K/V context; the KV projector."""

    KIND = "aasd"
    WEIGHTS = "aasd.safetensors"
    CONFIG = "aasd_config.json"
    CONFIG_CLS = AasdConfig
    reads_visual = False

    def __init__(self, config: AasdConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        if not isinstance(config, AasdConfig):
            raise ValueError(f"aasd: the head needs an AasdConfig, got {type(config).__name__}")
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"aasd: attention {attn_implementation!r} cannot take custom masks; use sdpa/eager")
        self.config = config
        self.llama_config = config.llama_config(attn_implementation)
        self.layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(self.llama_config)
        pool = average_pool(config.image_tokens or 1, config.kv_tokens)  # [k, T_img] contiguous average pooling
        self.w_k = nn.Parameter(pool.clone())  # [k, T_img] W_K
        self.w_v = nn.Parameter(pool.clone())  # [k, T_img] W_V
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # not registered, not saved, not trained

    # ---- the target's frozen embedding and lm_head (as EagleHead) --------------------------------------------

    def attach(self, embed: nn.Embedding, lm_head: nn.Linear, copy: bool = False) -> AasdHead:
        if embed.weight.shape[1] != self.config.hidden_size or lm_head.weight.shape != (
                self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"aasd: target embedding {tuple(embed.weight.shape)} / lm_head "
                             f"{tuple(lm_head.weight.shape)} do not fit the head (H={self.config.hidden_size}, "
                             f"V={self.config.vocab_size})")
        if copy:
            p = self.norm.weight
            e = nn.Embedding.from_pretrained(embed.weight.detach().to(p.device, p.dtype).clone(), freeze=True)
            w = lm_head.weight.detach()
            head = nn.Linear(w.shape[1], w.shape[0], bias=lm_head.bias is not None, device=p.device, dtype=p.dtype)
            with torch.no_grad():
                head.weight.copy_(w)
                if lm_head.bias is not None:
                    head.bias.copy_(lm_head.bias)
            embed, lm_head = e, head.requires_grad_(False)
        self._shared = (embed, lm_head)
        return self

    @property
    def attached(self) -> bool:
        return self._shared is not None

    def _need(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._shared is None:
            raise ValueError("aasd: the head has no embedding / lm_head; call attach() with the target's")
        return self._shared

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[..] int64 -> [.., H] in the head's dtype and device."""
        emb, p = self._need()[0], self.norm.weight
        return emb(ids.to(emb.weight.device)).to(p.device, p.dtype)

    def logits(self, h: torch.Tensor, int8: bool = False) -> torch.Tensor:
        """Features [.., H] -> fp32 logits [.., V] through the target's lm_head, on the head's device (``int8``: over
        an int8 copy of its weight, as ``EagleHead.logits``)."""
        head = self._need()[1]
        x = h.to(head.weight.device, head.weight.dtype)
        return (int8_weights.linear(head, x) if int8 else head(x)).float().to(self.norm.weight.device)

    @torch.no_grad()
    def init_from_target(self, model) -> AasdHead:
        """Copy the target's last decoder layer and final norm (a HF VLM or a specula Target)."""
        model = model.model if hasattr(model, "info") else model
        lm = model.model.language_model
        got = self.layer.load_state_dict(lm.layers[-1].state_dict(), strict=False)
        # a Qwen2 layer has q/k/v biases and none on o_proj: the head's o_proj bias (Llama's attention_bias covers
        # all four) starts at zero, so the copied layer computes exactly the target's
        if got.unexpected_keys or set(got.missing_keys) - {"self_attn.o_proj.bias"}:
            raise ValueError(f"aasd: the target's last layer does not fit the head (missing {got.missing_keys}, "
                             f"unexpected {got.unexpected_keys})")
        if got.missing_keys:
            self.layer.self_attn.o_proj.bias.zero_()
        self.norm.load_state_dict(lm.norm.state_dict())
        return self

    # ---- forward ------------------------------------------------------------------------------------------

    def compress(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3 on one image's cached keys/values [.., T_img, D] -> [.., k, D] each."""
        return (torch.einsum("rn,...nd->...rd", self.w_k.to(k.dtype), k),
                torch.einsum("rn,...nd->...rd", self.w_v.to(v.dtype), v))

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, int8: bool = False) -> torch.Tensor:
        """ids [B, T] int64 at position_ids [B, T]; ``cache``: a one-layer ``DynamicCache`` holding the context
        K/V [B, H_kv, S, D] (the target's, then the draft's own), to which this call's k'/v' are appended;
        attention_mask [B, 1, T, S + T] (bool for sdpa, additive for eager); ``int8``: a lean step's layer over
        int8 weights (``lean_llama.packed``). Returns h^ [B, T, H]."""
        x = self.embed(ids)  # [B, T, H]
        pos = position_ids.to(x.device)
        o = lean_llama.layer_step(self.layer, self.rotary, x, attention_mask, pos, cache, int8)  # drafting: lean
        if o is None:
            o = self.layer(x, attention_mask=attention_mask, position_ids=pos, past_key_values=cache, use_cache=True,
                           position_embeddings=self.rotary(x, pos))
        return self.norm(o)  # [B, T, H]

    @classmethod
    def load(cls, path: str | Path, target=None, *, device: str | torch.device | None = None,
             dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> AasdHead:
        """``eagle_head.load_eagle`` for this head (``aasd.safetensors`` + ``aasd_config.json``)."""
        return _load_head(cls, path, target, device=device, dtype=dtype, copy_shared=copy_shared)


def image_spans(ids: torch.Tensor, image_token_id: int | None, image_tokens: int | None) -> list[tuple[int, int]]:
    """(start, T_img) of every image in ids [L]: runs of image tokens cut into images of ``image_tokens`` (LLaVA),
    or with ``image_tokens`` None one image per run (Qwen2.5-VL, any size; ``drafters/image_runs.py``)."""
    from specula.drafters.image_runs import image_lengths, image_starts

    try:
        lengths = image_lengths(ids, image_token_id, image_tokens)
    except ValueError as e:
        raise ValueError(f"aasd: {e}") from None
    starts = image_starts(ids, image_token_id, lengths).tolist() if lengths else []
    return list(zip(starts, lengths))


def average_pool(n: int, k: int) -> torch.Tensor:
    """[min(k, n), n] contiguous average pooling of n tokens in row-major order (W_K / W_V's initial value)."""
    k = min(k, n)
    pool = torch.zeros(k, n)
    for r, chunk in enumerate(torch.arange(n).tensor_split(k)):
        pool[r, chunk] = 1.0 / len(chunk)
    return pool


def context_kv(head: AasdHead, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One row's draft context from the target's last-layer cache: ids [L], k/v [H_kv, L, D] -> (k, v) [H_kv, S, D]
    (text entries as they are, each image's entries compressed, in sequence order) and the source position of each
    entry [S] int64 (a compressed image: its last token's position). An image of the head's fixed ``image_tokens``
    goes through the learned W_K / W_V; an image of any size on a target without a fixed count (Qwen2.5-VL) is
    average-pooled to min(kv_tokens, T_img) entries, W's initial form (a learned matrix needs one size)."""
    cfg = head.config
    spans = image_spans(ids, cfg.image_token_id, cfg.image_tokens)
    if not spans:
        return k, v, torch.arange(k.shape[1])
    ks, vs, src, prev = [], [], [], 0
    for s, t in spans:
        ks.append(k[:, prev:s])
        vs.append(v[:, prev:s])
        src.append(torch.arange(prev, s))
        if cfg.image_tokens is not None:
            ck, cv = head.compress(k[:, s:s + t], v[:, s:s + t])  # [H_kv, k, D]
        else:
            w = average_pool(t, cfg.kv_tokens).to(k.device, k.dtype)  # [k', T_img]
            ck, cv = torch.einsum("rn,...nd->...rd", w, k[:, s:s + t]), torch.einsum("rn,...nd->...rd", w, v[:, s:s + t])
        ks.append(ck)
        vs.append(cv)
        src.append(torch.full((ck.shape[1],), s + t - 1))
        prev = s + t
    ks.append(k[:, prev:])
    vs.append(v[:, prev:])
    src.append(torch.arange(prev, k.shape[1]))
    return torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(src)


def load_aasd(path: str | Path, target=None, *, device: str | torch.device | None = None,
              dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> AasdHead:
    """Load an exported AASD head (a directory or a zoo name) and attach the target's embedding / lm_head.

        head = load_aasd("aasd", target)             # zoo/weights/aasd, shares the target's lm_head
    """
    return AasdHead.load(path, target, device=device, dtype=dtype, copy_shared=copy_shared)
