"""The frozen dataclasses that cross the target's boundary (to the runtime, the drafters and the wire).

Conventions used in every shape comment:
  B      rows (requests) in the call, in the order of its ``request_ids``
  L      longest prompt in a prefill call (rows are right-padded; ``lengths`` says how many are real)
  N      draft nodes per row in a verify block (rows with fewer nodes are padded; ``counts`` says how many)
  n      N + 1: verify positions per row, position 0 is the pending token (see ``VerifyOutput``)
  V      vocabulary size, H hidden size, H_kv key/value heads, D head dim, N_img images, T_img tokens per image
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VARIANTS = ("projected", "pre_projector", "pooled")


@dataclass(frozen=True)
class TargetInfo:
    """What other stages need to know about the target, without touching the model."""

    model_type: str  # HF config model_type: "llava" | "qwen2_5_vl"
    vocab_size: int  # rows of the LM head output (logits last dim)
    hidden_size: int  # H of the language model
    num_layers: int  # decoder layers of the language model
    num_kv_heads: int  # H_kv of the cached keys/values
    head_dim: int  # D of the cached keys/values
    image_token_id: int  # placeholder id a processor expands once per visual token
    eos_token_ids: tuple[int, ...]  # ids that end generation (generation_config, else text config)
    visual_tokens_per_image: int | None  # fixed count for LLaVA; None for Qwen2.5-VL (depends on image size)
    vision_hidden_size: int  # D_vis of the vision tower (pre-projector feature width per patch)
    feature_layers: tuple[int, ...]  # hidden-state indices returned as TargetFeatures.layer_hidden
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # e.g. "float32", "float16", "bfloat16"


@dataclass(frozen=True)
class VisualFeatures:
    """Per-image visual features from ``Target.encode_images``, padded to the longest image.

    ``variant`` is one of:
      "projected"      what the LM consumes in place of the image tokens (D = H)
      "pre_projector"  vision tower features as the model selects them before its projector
                       (LLaVA: D = D_vis, or D_vis * len(vision_feature_layer) for a layer list;
                        Qwen2.5-VL: the ViT output grouped by merge unit, D = D_vis * merge**2)
      "pooled"         projected features average-pooled on the token grid to g*g tokens (D = H)
    """

    variant: str
    features: torch.Tensor  # [N_img, T_max, D] model dtype; rows past lengths[i] are zero
    lengths: tuple[int, ...]  # T_img per image (all equal for LLaVA)
    grid_hw: tuple[tuple[int, int], ...]  # token grid (rows, cols) per image; LLaVA "full" adds a leading CLS
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] int64 Qwen2.5-VL patch grid (mrope needs it), else None
    # the same images' "pre_projector" features when a separate vision stage computed them too (for a drafter with
    # its own projector, so the verifier need not run the tower again): [N_img, T_max, D_pre]
    pre_projector: torch.Tensor | None = None

    def per_image(self) -> list[torch.Tensor]:
        """Unpadded features, one [T_img, D] tensor per image."""
        return [self.features[i, :t] for i, t in enumerate(self.lengths)]

    @property
    def num_images(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class PrefillRequest:
    """One new request: its prompt (image tokens already expanded by a processor) and its images.

    Give either ``pixel_values`` or ``visual`` (projected embeddings computed by a separate vision stage), or
    neither for a text-only prompt.
    """

    request_id: str
    input_ids: torch.Tensor  # [L_i] int64
    pixel_values: torch.Tensor | None = None  # LLaVA [N_img, 3, S, S]; Qwen2.5-VL [P, C*tp*p*p] flattened patches
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] int64, Qwen2.5-VL only (with pixel_values or visual)
    visual: VisualFeatures | torch.Tensor | None = None  # "projected" features, or a [N_img, T_img, H] tensor


@dataclass(frozen=True)
class TargetFeatures:
    """What drafters consume, for the positions a call computed.

    ``hidden`` is the final-norm hidden state (what the LM head reads). ``layer_hidden[k]`` is HF
    ``hidden_states[feature_layers[k]]``: index 0 is the input embeddings, index i the output of decoder layer i,
    and index num_layers is (in transformers 5) the final-norm state again. Keys are cached post-RoPE.
    """

    hidden: torch.Tensor  # [B, T, H] model dtype; T = L (prefill) or n (verify); positions >= lengths are padding
    lengths: tuple[int, ...]  # valid positions per row
    layers: tuple[int, ...]  # feature layer indices, same order as layer_hidden
    layer_hidden: tuple[torch.Tensor, ...]  # each [B, T, H] model dtype
    last_k: torch.Tensor  # [B, H_kv, T, D] model dtype, last decoder layer
    last_v: torch.Tensor  # [B, H_kv, T, D] model dtype, last decoder layer


@dataclass(frozen=True)
class PrefillOutput:
    request_ids: tuple[str, ...]
    logits: torch.Tensor  # [B, V] fp32, next-token logits after the last prompt token
    features: TargetFeatures  # T = L, lengths = prompt lengths


@dataclass(frozen=True)
class DraftBlock:
    """Draft nodes to verify, one row per live request.

    Node i of a row is ``tokens[b, i]``. ``parents[b, i]`` is the index of its parent node, or -1 if it hangs off
    the pending token (the last committed token, not yet in the cache). A parent must precede its child. A chain is
    ``parents = None`` (node i's parent is i-1). Rows with fewer nodes set ``counts``; entries past a row's count
    are ignored.

    Example, a tree of 4 nodes: two candidates for the first token and one child each::

        tokens  = [[17, 23, 5, 9]]     # node 0 = 17, node 1 = 23, node 2 = 5 (after 17), node 3 = 9 (after 23)
        parents = [[-1, -1, 0, 1]]
    """

    request_ids: tuple[str, ...]
    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor | None = None  # [B, N] int64; None = chain
    counts: tuple[int, ...] | None = None  # nodes per row, each <= N; None = N for every row

    @classmethod
    def chain(cls, request_ids, tokens: torch.Tensor, counts=None) -> DraftBlock:
        return cls(tuple(request_ids), tokens, None, None if counts is None else tuple(int(c) for c in counts))


@dataclass(frozen=True)
class VerifyOutput:
    """Target outputs for a verified block.

    Position 0 is the pending token, position 1 + i is draft node i. ``logits[b, 0]`` is the target distribution
    for the first draft token (after the committed prefix); ``logits[b, 1 + i]`` the distribution for the token
    after node i. For a chain of gamma tokens, ``logits[:, j]`` follows draft token j - 1, and ``logits[:, gamma]``
    is the bonus position.
    """

    request_ids: tuple[str, ...]
    logits: torch.Tensor  # [B, n, V] fp32
    features: TargetFeatures  # T = n, lengths = counts + 1


@dataclass(frozen=True)
class Accept:
    """The verdict for one row: the accepted draft nodes and the next token (not yet in the cache).

    ``path`` lists node indices from the root to the deepest accepted node; for a chain it is ``0..k-1``. Right after
    prefill (no block verified) use ``path=()`` and the sampled first token.
    """

    request_id: str
    path: tuple[int, ...]
    next_token: int

    @classmethod
    def chain(cls, request_id: str, num_accepted: int, next_token: int) -> Accept:
        return cls(request_id, tuple(range(int(num_accepted))), int(next_token))
