"""The EAGLE head: one stock ``LlamaDecoderLayer`` over fc(concat(e(x_{i+1}), h_i)), read by the target's lm_head.

Notation (EAGLE, MSD eq. 4-5): ``h_i`` is the target's final-norm hidden state at token x_i (what its lm_head reads),
``e(x)`` the target's input embedding of token x. The head's input at position i is the *pair* (h_i, x_{i+1}):

    f_i = fc(concat(e(x_{i+1}), h_i))            # [.., 2H] -> [.., H]
    h^_{i+1} = layer(f_0 .. f_i)                 # one causal decoder layer, its own KV cache
    q(x_{i+2}) = softmax(lm_head(h^_{i+1}) / T)

Trained on the target's hidden states (``training/drafters/eagle.py``): SmoothL1(h^_{i+1}, h_{i+1}) + w * CE. At draft
time a committed position uses the target's true h_i; a draft position uses the head's own prediction h^.

The target's embedding and lm_head are *not* part of the head: they are frozen and shared by reference with the
target (``attach``), so the head's weight file holds fc + the layer only (``load_eagle``). A drafter running on
another device than the target (a separate drafter replica) gets frozen copies instead (``attach(copy=True)``, or
``embedding_from_checkpoint`` when no target is in the process).

Image tokens: the baseline treats them like text (MSD's "Baseline", sec. 3.3 and 5.3): the pair at an image
position is (h_i, e(x_{i+1})) with e(<image>) the embedding-table row of the image token, a constant marker; the
image reaches the head through the target's hidden states h_i at the image positions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specula.drafters import int8_weights, lean_llama

WEIGHTS = "eagle.safetensors"
CONFIG = "eagle_config.json"


@dataclass(frozen=True)
class EagleConfig:
    """Sizes of the head; ``from_target`` copies the target LM's (EAGLE uses one target-shaped decoder layer)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's (the lm_head it reads)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    image_token_id: int | None = None  # never proposed (its q is 0)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}.{f} must be an integer >= 1, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{type(self).__name__}.num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(cls, target) -> EagleConfig:
        """From a ``specula.targets`` Target (or a HF VLM with ``config.text_config``)."""
        model = target.model if hasattr(target, "info") else target  # a specula Target or the HF model itself
        tc = model.config.text_config
        rope = getattr(tc, "rope_parameters", None) or {}
        heads = tc.num_attention_heads
        image = getattr(model.config, "image_token_id", None)
        if image is None:
            image = getattr(model.config, "image_token_index", None)
        return cls(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   vocab_size=model.get_output_embeddings().out_features, rms_norm_eps=float(tc.rms_norm_eps),
                   rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
                   max_position_embeddings=int(tc.max_position_embeddings),
                   image_token_id=None if image is None else int(image))

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        cfg = LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                          num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                          head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size,
                          rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                          rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        cfg._attn_implementation = attn_implementation
        return cfg

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> EagleConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
        return cls(**raw)


class EagleHead(nn.Module):
    """fc + one LlamaDecoderLayer (+ its rotary embedding). ``embed`` / ``lm_head`` come from ``attach``.

    Subclasses (``drafters/msd_head.py``) change what the layer reads at some positions; the class attributes name
    their kind, files and config class, so saving, loading and the training recipe serve them all."""

    KIND = "eagle"
    WEIGHTS = WEIGHTS
    CONFIG = CONFIG
    CONFIG_CLS = EagleConfig
    reads_visual = False  # whether forward wants the target's input embeddings at image positions (``visual``)

    def __init__(self, config: EagleConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        if not isinstance(config, self.CONFIG_CLS):
            raise ValueError(f"{self.KIND}: the head needs a {self.CONFIG_CLS.__name__}, got {type(config).__name__}")
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"{self.KIND}: attention {attn_implementation!r} cannot take custom masks; use sdpa/eager")
        self.config = config
        self.llama_config = config.llama_config(attn_implementation)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(self.llama_config)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # a tuple: not registered, not saved, not trained

    # ---- the target's frozen embedding and lm_head -------------------------------------------------------------

    def attach(self, embed: nn.Embedding, lm_head: nn.Linear, copy: bool = False) -> EagleHead:
        """Use the target's ``embed`` / ``lm_head`` (by reference; ``copy=True``: frozen copies on the head's
        device). Their shapes must match the config."""
        if embed.weight.shape[1] != self.config.hidden_size or lm_head.weight.shape != (
                self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"eagle: target embedding {tuple(embed.weight.shape)} / lm_head "
                             f"{tuple(lm_head.weight.shape)} do not fit the head (H={self.config.hidden_size}, "
                             f"V={self.config.vocab_size})")
        if copy:
            p = self.fc.weight
            e = nn.Embedding.from_pretrained(embed.weight.detach().to(p.device, p.dtype).clone(), freeze=True)
            w = lm_head.weight.detach()
            head = nn.Linear(w.shape[1], w.shape[0], bias=lm_head.bias is not None, device=p.device, dtype=p.dtype)
            with torch.no_grad():
                head.weight.copy_(w)
                if lm_head.bias is not None:
                    head.bias.copy_(lm_head.bias)
            head.requires_grad_(False)
            embed, lm_head = e, head
        self._shared = (embed, lm_head)
        return self

    @property
    def attached(self) -> bool:
        return self._shared is not None

    def _need(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._shared is None:
            raise ValueError("eagle: the head has no embedding / lm_head; call attach() with the target's")
        return self._shared

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[..] int64 -> [.., H] in the head's dtype, on the head's device."""
        emb = self._need()[0]
        p = self.fc.weight
        return emb(ids.to(emb.weight.device)).to(p.device, p.dtype)

    def logits(self, h: torch.Tensor, int8: bool = False) -> torch.Tensor:
        """Predicted features [.., H] -> fp32 logits [.., V] through the target's lm_head, on the head's device
        (``int8``: over an int8 copy of the lm_head's weight, ``int8_weights.linear``; the target's own is left
        untouched)."""
        head = self._need()[1]
        x = h.to(head.weight.device, head.weight.dtype)
        return (int8_weights.linear(head, x) if int8 else head(x)).float().to(self.fc.weight.device)

    # ---- forward --------------------------------------------------------------------------------------------

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None, int8: bool = False) -> torch.Tensor:
        """One pass over pairs (hidden[:, t], next_ids[:, t]) -> predicted next features [B, T, H].

        next_ids [B, T] int64 (x_{i+1}), hidden [B, T, H] (h_i, target's or predicted), position_ids [B, T] int64,
        attention_mask: 4-D [B, 1, T, S + T] (bool for sdpa, additive float for eager) or None (plain causal).
        ``cache``: a ``DynamicCache`` with one layer to append to, or None (training: whole sequences).
        ``int8``: a lean step's layer over int8 weights (``lean_llama.packed``).
        """
        return self.decode(self.pair_inputs(next_ids, hidden, int8), position_ids, attention_mask, cache, int8)

    def pair_inputs(self, next_ids: torch.Tensor, hidden: torch.Tensor, int8: bool = False) -> torch.Tensor:
        """f_i = fc(concat(e(x_{i+1}), h_i)): next_ids [B, T] int64, hidden [B, T, H] -> [B, T, H] (``int8``: fc over
        an int8 copy of its weight)."""
        p = self.fc.weight
        x = torch.cat([self.embed(next_ids), hidden.to(p.device, p.dtype)], dim=-1)  # [B, T, 2H]
        return int8_weights.linear(self.fc, x) if int8 else self.fc(x)

    def decode(self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               cache=None, int8: bool = False) -> torch.Tensor:
        """The decoder layer over inputs x [B, T, H] (``forward``'s other arguments) -> [B, T, H]."""
        pos = position_ids.to(x.device)
        lean = lean_llama.layer_step(self.layer, self.rotary, x, attention_mask, pos, cache, int8)
        if lean is not None:  # drafting: the same math without HF's per-call overhead
            return lean  # [B, T, H]
        cos_sin = self.rotary(x, pos)
        return self.layer(x, attention_mask=attention_mask, position_ids=pos, past_key_values=cache,
                          use_cache=cache is not None, position_embeddings=cos_sin)  # [B, T, H]

    @classmethod
    def load(cls, path: str | Path, target=None, *, device: str | torch.device | None = None,
             dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> EagleHead:
        """``load_eagle`` for this head class (its files, its config)."""
        return _load_head(cls, path, target, device=device, dtype=dtype, copy_shared=copy_shared)


def head_parameters(config: EagleConfig) -> int:
    """Trainable parameters of a head (fc + layer): what the weight file holds."""
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return 2 * h * h + h + h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h


def save_head(head: EagleHead, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """``eagle.safetensors`` (fc + layer, ``dtype``) and ``eagle_config.json`` into ``out`` (a subclass: its own
    ``WEIGHTS`` / ``CONFIG`` names)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, out / head.WEIGHTS, metadata={"format": f"specula-{head.KIND}/1"})
    (out / head.CONFIG).write_text(head.config.to_json())


def load_eagle(path: str | Path, target=None, *, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> EagleHead:
    """Load an exported head (a directory or a zoo name) and attach the target's embedding / lm_head.

    ``target``: a ``specula.targets`` Target or a HF VLM; ``None`` reads the two tensors from the checkpoint named
    by ``specula.json``'s "target" instead (``embedding_from_checkpoint``). ``device``: default the target's;
    ``dtype``: default float32 (weights are stored in fp16). ``copy_shared``: copy instead of sharing (default:
    copy only when the head's device differs from the target's).

        head = load_eagle("eagle", target)           # zoo/weights/eagle, shares the target's lm_head
    """
    return _load_head(EagleHead, path, target, device=device, dtype=dtype, copy_shared=copy_shared)


def _load_head(cls: type[EagleHead], path, target, *, device, dtype, copy_shared) -> EagleHead:
    from safetensors.torch import load_file

    from specula.zoo.store import resolve, resolve_ref

    d = resolve(path)
    if not (d / cls.WEIGHTS).exists() or not (d / cls.CONFIG).exists():
        raise ValueError(f"{cls.KIND}: {d} holds no {cls.WEIGHTS} + {cls.CONFIG}")
    cfg = cls.CONFIG_CLS.from_json((d / cls.CONFIG).read_text())
    dt = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    model = target.model if hasattr(target, "info") else target
    if device is None:
        device = next(model.parameters()).device if model is not None else "cpu"
    head = cls(cfg)
    head.load_state_dict({k: v.to(dt) for k, v in load_file(d / cls.WEIGHTS).items()})
    head.to(device=device, dtype=dt).eval().requires_grad_(False)
    if model is not None:
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        if copy_shared is None:
            copy_shared = torch.device(device) != embed.weight.device
        head.attach(embed, lm_head, copy=copy_shared)
    else:
        meta = json.loads((d / "specula.json").read_text()) if (d / "specula.json").exists() else {}
        if "target" not in meta:
            raise ValueError(f"{cls.KIND}: {d} names no target; pass target=")
        embed, lm_head = embedding_from_checkpoint(resolve_ref(meta["target"], d), cfg)
        head.attach(embed, lm_head, copy=True)
    return head


def embedding_from_checkpoint(target: str | Path, cfg: EagleConfig) -> tuple[nn.Embedding, nn.Linear]:
    """Only the target's input embedding and lm_head, read from its safetensors (tied heads share one tensor)."""
    from safetensors import safe_open

    from specula.zoo.store import resolve

    d = resolve(target)
    found: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                if k.endswith("embed_tokens.weight") and ("language_model" in k or k == "model.embed_tokens.weight"):
                    found["embed"] = h.get_tensor(k)
                elif k.endswith("lm_head.weight"):
                    found["lm_head"] = h.get_tensor(k)
    if "embed" not in found:
        raise ValueError(f"eagle: no language-model embed_tokens.weight in {d}")
    w = found.get("lm_head", found["embed"])  # tied when absent
    embed = nn.Embedding.from_pretrained(found["embed"].float(), freeze=True)
    head = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(w.float())
    if head.weight.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"eagle: {d}'s lm_head {tuple(head.weight.shape)} does not fit the head")
    return embed, head.requires_grad_(False)
