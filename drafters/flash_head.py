"""The FLASH head (Fast Latent-Aware Semi-Autoregressive Heuristics): an EAGLE head that reads each image through a
few learned latent tokens and emits k draft features per forward pass.

    text position i (x_i text)    f_i = fc(concat(e(x_{i+1}), h_i))             (EAGLE, as ``eagle_head``)
    image of T_img tokens         c_1 .. c_m = softmax(Q F^T / sqrt(H)) F        (FLASH eq. 3: m learned queries
                                                                                   Q [m, H] attend F [T_img, H])
    o_i = layer(f_0 .. f_i)       one target-shaped decoder layer over the draft sequence (images -> m tokens each)
    h^_{i+j} = o_i + SiLU(W_j o_i + b_j),  j = 1 .. k                           (the semi-autoregressive head)
    q(x_{i+j+1}) = softmax(lm_head(h^_{i+j}) / T)                               (the target's frozen lm_head)

So one forward at the last committed pair gives k distributions, for the next k tokens; ``drafters/flash.py`` draws
each token from its own q_j (q_j was fixed before any of the k draws, so the q the sampler gets is exactly the law
each token was drawn from) and feeds the k new pairs (h^_{i+j}, x_{i+j+1}) in one more forward when gamma > k.

Choices the paper leaves open, made here:
- F is the projected visual embedding the target's LM reads at the image positions (``DraftContext.visual``), so
  compression sees what the target saw; eq. 3 has no key/value projections (F is both), and neither has this.
- Compression is per image (T_img -> m, ``visual_tokens``, default 64 and never more than T_img); the m tokens
  replace the image's T_img positions in the draft sequence, whose position ids are its own (0, 1, .. over the
  shorter sequence), in training and at inference alike.
- Images of any size (Qwen2.5-VL; ``FlashConfig.image_tokens`` None): each run of image tokens is one image
  (``drafters/image_runs.py``), and an image of T_img tokens becomes m_img = min(m, T_img) latent tokens, read by
  the first m_img queries, attending that image's own T_img tokens only (never the padding of
  ``DraftContext.visual`` [N_img, T_max, H]). So an image never grows the draft sequence, a head serves image sizes
  it never saw (trained on Qwen, it has seen several), and with a fixed T_img >= m (LLaVA: ``image_tokens`` set,
  runs may touch) every image is m tokens, computed exactly as before.
- The compressed tokens are fed to the layer as they are (as MSD feeds raw visual embeddings): the layer's input
  RMSNorm rescales them.
- The text position just before an image pairs h_i with e(<image>) (a constant marker), as ``eagle`` / ``msd``.
- The k output features come from Medusa-style residual blocks on the layer output (W_j zero-initialised, so at
  the start every h^_{i+j} = o_i and k = 1 is exactly the EAGLE head); the paper's figure does not say how one
  pass yields k features.
- Features are the target's final-norm hidden states (what its lm_head reads, as in our ``eagle``), not the
  second-to-top layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specula.drafters.eagle_head import EagleConfig, EagleHead
from specula.drafters.image_runs import image_lengths, image_starts


@dataclass(frozen=True)
class FlashConfig(EagleConfig):
    tokens_per_pass: int = 4  # k: draft tokens one forward pass emits
    visual_tokens: int = 64  # m: latent tokens per image after compression
    image_tokens: int | None = None  # T_img of the target (LLaVA: fixed per image); None: one image per run, any size

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("tokens_per_pass", "visual_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FlashConfig.{f} must be an integer >= 1, got {v!r}")
        t = self.image_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"FlashConfig.image_tokens must be an integer >= 1 or None, got {t!r}")
        if t is not None and self.visual_tokens > t:
            raise ValueError(f"FlashConfig.visual_tokens ({self.visual_tokens}) must be <= image_tokens ({t})")

    @classmethod
    def from_target(cls, target, **overrides) -> FlashConfig:
        """Sizes from the target (``EagleConfig.from_target``) plus its visual tokens per image; ``visual_tokens``
        is capped at that count."""
        base = EagleConfig.from_target(target)
        model = target.model if hasattr(target, "info") else target
        t = getattr(model.config, "image_seq_length", None)
        fields = {**base.__dict__, "image_tokens": None if t is None else int(t), **overrides}
        if fields["image_tokens"] is not None:
            fields["visual_tokens"] = min(fields.get("visual_tokens", 64), fields["image_tokens"])
        return cls(**fields)


class FlashHead(EagleHead):
    """EagleHead + the latent queries of the visual compressor + k residual output blocks."""

    KIND = "flash"
    WEIGHTS = "flash.safetensors"
    CONFIG = "flash_config.json"
    CONFIG_CLS = FlashConfig
    reads_visual = True

    def __init__(self, config: FlashConfig, attn_implementation: str = "sdpa"):
        super().__init__(config, attn_implementation)
        h = config.hidden_size
        self.queries = nn.Parameter(torch.randn(config.visual_tokens, h))  # [m, H]
        self.offsets = nn.ModuleList(nn.Linear(h, h) for _ in range(config.tokens_per_pass))
        for lin in self.offsets:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def compress(self, visual: torch.Tensor) -> torch.Tensor:
        """Eq. 3 per image: visual [N_img, T_img, H] -> [N_img, m, H] (head dtype)."""
        return self._attend(self.queries, visual)

    def compress_images(self, images) -> torch.Tensor:
        """Eq. 3 for images of any sizes: ``images`` one [T_img, H] per image (or [N_img, T_img, H]) -> their latent
        tokens in order [sum_j m_j, H], m_j = min(m, T_j) (``image_latents``), each image attending its own tokens
        only. Images of one size >= m compress as one batch (``compress``, bit for bit)."""
        images = list(images)
        m = self.config.visual_tokens
        if not images:
            return self.queries.new_zeros(0, self.config.hidden_size)
        if len({f.shape[0] for f in images}) == 1 and images[0].shape[0] >= m:
            return self.compress(torch.stack(images)).reshape(-1, self.config.hidden_size)
        return torch.cat([self._attend(self.queries[: min(m, f.shape[0])], f[None])[0] for f in images])

    def _attend(self, queries: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
        """queries [m, H] attend visual [N_img, T, H] (F both keys and values) -> [N_img, m, H]."""
        p = self.fc.weight
        v = visual.to(p.device, p.dtype)
        att = torch.einsum("mh,nth->nmt", queries, v) / math.sqrt(v.shape[-1])  # [N_img, m, T_img]
        return torch.einsum("nmt,nth->nmh", att.softmax(-1), v)

    def expand(self, o: torch.Tensor) -> torch.Tensor:
        """Layer outputs [.., H] -> the k predicted features [.., k, H] (h^_{i+1} .. h^_{i+k})."""
        return torch.stack([o + F.silu(lin(o)) for lin in self.offsets], dim=-2)


def image_latents(m: int, lengths) -> tuple[int, ...]:
    """Latent tokens per image: m_j = min(m, T_j) (module docstring)."""
    return tuple(min(int(m), int(t)) for t in lengths)


@dataclass(frozen=True)
class Layout:
    """Where one row's pairs go in the (shorter) draft sequence: text pairs keep their order, each image's T_img
    pairs become its m_img compressed tokens."""

    text_pos: torch.Tensor  # [n_text] int64 pair indices i with x_i text
    text_slot: torch.Tensor  # [n_text] int64 their draft-sequence index
    image_slot: torch.Tensor  # [N_img, max m_img] int64 draft-sequence indices of each image's compressed tokens
    #                           (-1 past image j's latents[j]; with every m_img equal, none)
    length: int  # L' draft-sequence length
    lengths: tuple[int, ...] = ()  # T_img per image
    latents: tuple[int, ...] = ()  # m_img per image

    @property
    def slots(self) -> torch.Tensor:
        """Every image's compressed-token slots in order [sum m_img] int64."""
        return self.image_slot[self.image_slot >= 0]


def layout(ids: torch.Tensor, image_token_id: int | None, image_tokens: int | None, m: int) -> Layout:
    """ids [L] int64 (x_i of each pair) -> ``Layout``. With ``image_tokens`` set, runs of image tokens must be whole
    images of that many tokens each (consecutive images may touch; LLaVA); None: each run is one image, of any size
    (Qwen2.5-VL). An image of T_img tokens takes min(m, T_img) slots."""
    ids = ids.cpu()
    try:
        lengths = image_lengths(ids, image_token_id, image_tokens)
    except ValueError as e:
        raise ValueError(f"flash: {e}") from None
    lat = image_latents(m, lengths)
    starts = image_starts(ids, image_token_id, lengths)  # [N_img] first token of each image
    shrink = torch.zeros(len(ids) + 1, dtype=torch.long)  # [L + 1] positions each image saves, from its end on
    if lengths:
        ends = starts + torch.tensor(lengths, dtype=torch.long)
        shrink.index_add_(0, ends, torch.tensor([t - k for t, k in zip(lengths, lat)], dtype=torch.long))
    saved = shrink.cumsum(0)[:-1]  # [L] positions saved by the images before each position
    img = ids == image_token_id if image_token_id is not None else torch.zeros_like(ids, dtype=torch.bool)  # [L]
    text_pos = torch.nonzero(~img).flatten()
    width = max(lat, default=0)
    image_slot = torch.full((len(lengths), width), -1, dtype=torch.long)  # [N_img, max m_img]
    for j, (s, k) in enumerate(zip(starts.tolist(), lat)):
        image_slot[j, :k] = s - int(saved[s]) + torch.arange(k)
    length = len(ids) - sum(lengths) + sum(lat)
    return Layout(text_pos, text_pos - saved[text_pos], image_slot, length, tuple(lengths), lat)


def draft_inputs(head: FlashHead, pairs: torch.Tensor, compressed: torch.Tensor | None, lay: Layout) -> torch.Tensor:
    """One row's draft sequence [L', H]: pairs [L, H] (fc(..) at every pair) placed at the text slots, compressed
    (the images' latent tokens in order, [N_img, m, H] or [sum m_img, H]) at the image slots."""
    x = pairs.new_zeros(lay.length, pairs.shape[-1])  # [L', H]
    x = x.index_copy(0, lay.text_slot.to(x.device), pairs[lay.text_pos.to(x.device)])
    if lay.image_slot.numel():
        x = x.index_copy(0, lay.slots.to(x.device), compressed.reshape(-1, x.shape[-1]).to(x.dtype))
    return x


def load_flash(path: str | Path, target=None, *, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> FlashHead:
    """Load an exported FLASH head (``flash.safetensors`` + ``flash_config.json``; a directory or a zoo name); see
    ``eagle_head.load_eagle``.

        head = load_flash("flash", target)           # zoo/weights/flash, shares the target's lm_head
    """
    return FlashHead.load(path, target, device=device, dtype=dtype, copy_shared=copy_shared)
