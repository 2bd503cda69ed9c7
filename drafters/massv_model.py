"""The MASSV drafter model: a small Llama LM over the target's tokenizer with its own projector over the *target's*
vision features (MASSV, sec. 3: "integrates the target VLM's frozen vision encoder into the SLM through a randomly
initialized MLP-based projector").

    e_i = embed(x_i)                              x_i a text token
    e_i = projector(f_j)                          x_i the j-th image token of the context (row-major per image)

``f`` are the target's features of the image, never recomputed by the drafter: ``config.feature`` says which ones,
``"pre_projector"`` (the vision tower's selected hidden states, MASSV's choice and the default) or ``"projected"``
(what the target's own projector made of them). The projector is LLaVA's 2-layer MLP (Linear, GELU, Linear).

Pooled drafting (IbED sec. 5.1) average-pools ``f`` on each image's token grid *before* the projector, so one model
serves the full grid and every pooled grid. A drafter sees only an image's token count, not its grid: a square
count pools on the square grid (LLaVA's; for Qwen2.5-VL a guess, right for a square image: 16 tokens may be 2 x 8);
any other count (a Qwen2.5-VL image of another aspect, whose rows x cols the ids do not tell) pools its row-major
tokens in g_h*g_w equal runs (``pool_image``). A wrong guess costs acceptance, never correctness.

Caption mode (IbED sec. 5.2, "a lightweight captioner"): the same model, given one image and the caption
instruction ``config.caption_prompt``, answers greedily; the tokens of that answer replace the image in a
text-only drafting context.

On disk (``save`` / ``load``): the LM as a stock ``LlamaForCausalLM`` directory (so ``text_lm`` can load it too, as
the text-only drafter it contains), ``massv_projector.safetensors`` and ``massv_config.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FEATURES = ("pre_projector", "projected")
PROJECTOR_FILE = "massv_projector.safetensors"
CONFIG_FILE = "massv_config.json"


@dataclass(frozen=True)
class MassvConfig:
    feature_dim: int  # D of the target features the projector reads
    image_token_id: int  # the target's image placeholder id (same tokenizer)
    feature: str = "pre_projector"  # which target features: "pre_projector" | "projected"
    projector_hidden: int = 0  # width of the projector's hidden layer (0 = the LM's hidden size)
    caption_prompt: tuple[int, ...] = ()  # chat-formatted caption instruction holding ONE image token ([] = none)
    caption_max_tokens: int = 48  # longest caption, in tokens
    eos_token_id: int | None = None  # ends a caption

    def __post_init__(self) -> None:
        if self.feature not in FEATURES:
            raise ValueError(f"MassvConfig.feature must be one of {FEATURES}, got {self.feature!r}")
        for name in ("feature_dim", "image_token_id", "caption_max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "image_token_id" else 1):
                raise ValueError(f"MassvConfig.{name} must be a positive integer, got {v!r}")
        if isinstance(self.projector_hidden, bool) or not isinstance(self.projector_hidden, int) \
                or self.projector_hidden < 0:
            raise ValueError(f"MassvConfig.projector_hidden must be an integer >= 0, got {self.projector_hidden!r}")
        if self.caption_prompt and list(self.caption_prompt).count(self.image_token_id) != 1:
            raise ValueError("MassvConfig.caption_prompt must hold exactly one image token")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> MassvConfig:
        d = json.loads(text)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"massv config: unknown fields {sorted(unknown)}")
        d["caption_prompt"] = tuple(d.get("caption_prompt", ()))
        return cls(**d)


def pool_features(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Average-pool each image's square token grid to ``grid`` = (g_h, g_w): [N_img, T, D] -> [N_img, g_h*g_w, D].

    The same adaptive pooling as the target's "pooled" variant (``targets.images.pool_grid``); a leading CLS token
    (T = s*s + 1) is dropped. 144 tokens (12 x 12) -> (6, 6) 36, (3, 3) 9, (1, 1) 1.
    """
    from specula.targets.images import pool_grid
    from specula.targets.types import VisualFeatures

    n, t, _ = features.shape
    side = math.isqrt(t)
    if side * side != t:
        side = math.isqrt(t - 1)
        if side * side != t - 1:
            raise ValueError(f"pooling needs a square token grid per image, got {t} tokens")
    vf = VisualFeatures("projected", features, (t,) * n, ((side, side),) * n)
    return pool_grid(vf, grid).features  # [N_img, g_h*g_w, D]


def square_grid(t: int) -> bool:
    """Whether T tokens are a square grid (s*s), or one with a leading CLS (s*s + 1): what ``pool_features`` pools."""
    return math.isqrt(t) ** 2 == t or (t > 1 and math.isqrt(t - 1) ** 2 == t - 1)


def pool_image(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """One image's features [T, D] -> [g_h*g_w, D]: ``pool_features`` on a square grid (a leading CLS dropped),
    else adaptive average pooling of the row-major token sequence into g_h*g_w runs (the grid is unknown)."""
    if square_grid(features.shape[0]):
        return pool_features(features[None], grid)[0]
    pooled = torch.nn.functional.adaptive_avg_pool1d(features.t()[None].float(), grid[0] * grid[1])  # [1, D, g*g]
    return pooled[0].t().to(features.dtype)  # [g_h*g_w, D]


def _decoder(lm: nn.Module, int8: bool = False):
    """A greedy decoder over ``lm``'s body with its own cache: ``step(embeds [B, T, H] | None, ids [B, T] | None, pos)
    -> last hidden [B, T, H]`` for T new tokens at positions pos.. (all rows aligned, causal). Through
    ``drafters/lean_llama.py`` (the same math without HF's per-call overhead) when the config qualifies, else the
    stock forward; ``int8``: the lean steps over int8 weights where the layers take them."""
    from transformers import DynamicCache

    from specula.drafters import lean_llama
    from specula.targets.kv import growable_cache

    body = lm.model
    lean = lean_llama.supported(lm.config)
    int8 = int8 and lean and lean_llama.int8_fits(lm.model.layers)
    cache = growable_cache(lm.config) if lean else DynamicCache(config=lm.config)

    def step(embeds, ids, pos: int) -> torch.Tensor:
        x = embeds if embeds is not None else ids
        b, t = x.shape[0], x.shape[1]
        dev = x.device
        positions = torch.arange(pos, pos + t, device=dev).expand(b, t)  # [B, T]
        if not lean:
            return body(inputs_embeds=embeds, input_ids=ids, position_ids=positions, past_key_values=cache,
                        use_cache=True).last_hidden_state
        mask = None  # one new token per row attends to every cached slot: no mask to build
        if t > 1:
            mask = torch.ones(t, pos + t, dtype=torch.bool, device=dev).tril(pos).expand(b, 1, t, pos + t)  # causal
        return lean_llama.model_forward(body, mask, positions, cache, input_ids=ids, inputs_embeds=embeds, int8=int8)

    return step


class MassvModel(nn.Module):
    """``lm`` (a LlamaForCausalLM) + ``projector``; see the module docstring."""

    def __init__(self, lm: nn.Module, config: MassvConfig):
        super().__init__()
        self.lm, self.config = lm, config
        d = lm.config.hidden_size
        h = config.projector_hidden or d
        self.projector = nn.Sequential(nn.Linear(config.feature_dim, h), nn.GELU(), nn.Linear(h, d))

    @property
    def hidden_size(self) -> int:
        return self.lm.config.hidden_size

    def embed(self, input_ids: torch.Tensor, visual: list[torch.Tensor | None]) -> torch.Tensor:
        """input_ids [B, L] int64; visual[b] [n_b, D] the features of row b's image tokens in order (n_b = its
        number of image tokens; None or [0, D] for a row without any) -> input embeddings [B, L, H]."""
        emb = self.lm.get_input_embeddings()(input_ids)  # [B, L, H]
        image = input_ids == self.config.image_token_id  # [B, L] bool
        rows = [b for b, v in enumerate(visual) if v is not None and v.shape[0]]
        counts = image.sum(1).tolist()
        for b in range(len(visual)):
            n = visual[b].shape[0] if visual[b] is not None else 0
            if n != counts[b]:
                raise ValueError(f"massv: row {b} has {counts[b]} image tokens and {n} visual feature rows")
        if not rows:
            return emb
        feats = torch.cat([visual[b] for b in rows]).to(emb.device, self.projector[0].weight.dtype)  # [n, D]
        proj = self.projector(feats).to(emb.dtype)  # [n, H]
        mask = torch.zeros_like(image)
        mask[rows] = image[rows]
        out = emb.clone()
        out[mask] = proj  # boolean indexing is row-major: row b's tokens in order, rows in order
        return out

    @torch.no_grad()
    def caption(self, features: torch.Tensor, max_tokens: int | None = None, int8: bool = False) -> list[list[int]]:
        """Greedy captions of images: features [N_img, T, D] (``config.feature``) -> one token list per image (EOS
        dropped); ``int8``: decoded over int8 layer weights (``lean_llama``; a drafter's captions, not training's).
        Every image is prompted with ``config.caption_prompt``, its image token expanded to T tokens, so all rows
        have one length and decode as one batch without padding."""
        cfg = self.config
        if not cfg.caption_prompt:
            raise ValueError("massv: this model has no caption_prompt (it was not trained for caption mode)")
        n, t, _ = features.shape
        if n == 0:
            return []
        max_tokens = cfg.caption_max_tokens if max_tokens is None else max_tokens
        dev = next(self.lm.parameters()).device
        prompt = []
        for tok in cfg.caption_prompt:
            prompt += [tok] * t if tok == cfg.image_token_id else [tok]
        ids = torch.tensor(prompt, dtype=torch.long, device=dev).expand(n, -1)  # [N_img, L]
        emb = self.embed(ids, list(features.to(dev)))  # [N_img, L, H]
        step = _decoder(self.lm, int8)
        hidden = step(emb, None, 0)  # [N_img, L, H]
        out: list[list[int]] = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        pos = ids.shape[1]
        for _ in range(max_tokens):
            logits = self.lm.get_output_embeddings()(hidden[:, -1]).float()  # [N_img, V]
            logits[:, cfg.image_token_id] = float("-inf")
            tok = logits.argmax(-1)  # [N_img]
            if cfg.eos_token_id is not None:
                done |= tok == cfg.eos_token_id
            for i, x in enumerate(tok.tolist()):
                if not done[i]:
                    out[i].append(x)
            if bool(done.all()):
                break
            hidden = step(None, tok[:, None], pos)  # [N_img, 1, H]
            pos += 1
        return out

    # ------------------------------------------------------------------------------------------------ files

    def save(self, out: str | Path, dtype: torch.dtype | None = None) -> Path:
        """LM directory + projector + config (``dtype``: storage dtype, e.g. fp16; compute dtype recorded fp32)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        lm = self.lm
        if dtype is not None:
            import copy

            lm = copy.deepcopy(self.lm).to(dtype)
        lm.save_pretrained(out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["dtype"] = "float32"  # stored in fp16 maybe, computed in fp32
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        sd = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in self.projector.state_dict().items()}
        save_file(sd, out / PROJECTOR_FILE)
        (out / CONFIG_FILE).write_text(self.config.to_json())
        return out

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype | None = None,
             attn_implementation: str = "sdpa") -> MassvModel:
        from transformers import AutoConfig, LlamaForCausalLM

        d = Path(path)
        if not (d / CONFIG_FILE).exists():
            raise FileNotFoundError(f"{d} holds no {CONFIG_FILE}: not a massv model")
        if AutoConfig.from_pretrained(d, local_files_only=True).model_type != "llama":
            raise ValueError(f"massv: {d} does not hold a Llama causal LM")
        lm = LlamaForCausalLM.from_pretrained(d, dtype=dtype or "auto", attn_implementation=attn_implementation,
                                              local_files_only=True)
        model = cls(lm, MassvConfig.from_json((d / CONFIG_FILE).read_text()))
        p = next(lm.parameters())
        model.projector.load_state_dict({k: v.to(p.dtype) for k, v in load_file(d / PROJECTOR_FILE).items()})
        return model.to(p.device, p.dtype)
