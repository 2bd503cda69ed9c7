"""The MSD head: the EAGLE head (``drafters/eagle_head.py``) with text and visual tokens decoupled (MSD eq. 8-9).

    f_i = fc(concat(e(x_{i+1}), h_i))     if x_i is a text token        (EAGLE, eq. 4)
    f_i = v_i                             if x_i is a visual token      (the raw projected visual embedding, eq. 2)
    h^_{i+1} = layer(f_0 .. f_i),  q(x_{i+2}) = softmax(lm_head(h^_{i+1}) / T)

``v_i`` is exactly what the target's language model reads at that image position: the output of its projector
(``Target.encode_images(.., "projected")``, ``DraftContext.visual``), fed to the layer as is (no fc, no noise; the
layer's input RMSNorm rescales it). Visual positions are only ever prompt positions, so drafting and the cache of
generated tokens are EAGLE's; only the prompt's image positions read differently.

Choices the paper leaves open, made here:
- The text position just before an image pairs h_i with e(<image>), the embedding-table row of the image token (a
  constant marker), as ``eagle`` does; the paper's e_{x_{i+1}} there could also be read as the first visual
  embedding. With the marker, ``decoupled=False`` is exactly the ``eagle`` head and the two modes differ only at
  visual positions (eq. 9's second case), which is what the ablation should isolate.
- A generated ``<image>`` token (never proposed, but a target may sample it) has no visual embedding: it is a
  text token to the head.
- Same weights and sizes as EAGLE (fc + one target-shaped decoder layer); ``MsdConfig.decoupled`` records how the
  head was trained; the drafter may override it (the ablation at inference).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specula.drafters.eagle_head import EagleConfig, EagleHead


@dataclass(frozen=True)
class MsdConfig(EagleConfig):
    decoupled: bool = True  # False: the EAGLE treatment of visual positions (the ablation)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.decoupled, bool):
            raise ValueError(f"MsdConfig.decoupled must be a bool, got {self.decoupled!r}")


class MsdHead(EagleHead):
    """fc + one LlamaDecoderLayer; at visual positions the layer reads the raw visual embedding instead of fc(..)."""

    KIND = "msd"
    WEIGHTS = "msd.safetensors"
    CONFIG = "msd_config.json"
    CONFIG_CLS = MsdConfig

    @property
    def reads_visual(self) -> bool:
        return self.config.decoupled

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache=None, visual: torch.Tensor | None = None,
                visual_mask: torch.Tensor | None = None, decoupled: bool | None = None, int8: bool = False
                ) -> torch.Tensor:
        """``EagleHead.forward`` plus: visual [B, T, H] the target's input embedding of x_i at each pair (only read
        where visual_mask [B, T] bool, True where x_i is a visual token); ``decoupled`` (default: the config's)
        False ignores them. Returns [B, T, H]."""
        x = self.pair_inputs(next_ids, hidden, int8)  # [B, T, H]
        dec = self.config.decoupled if decoupled is None else decoupled
        if dec and visual_mask is not None:
            m = visual_mask.to(x.device)[..., None]  # [B, T, 1]
            x = torch.where(m, visual.to(x.device, x.dtype), x)
        return self.decode(x, position_ids, attention_mask, cache, int8)


def load_msd(path: str | Path, target=None, *, device: str | torch.device | None = None,
             dtype: torch.dtype | str | None = None, copy_shared: bool | None = None) -> MsdHead:
    """Load an exported MSD head (``msd.safetensors`` + ``msd_config.json``, a directory or a zoo name); see
    ``eagle_head.load_eagle``.

        head = load_msd("msd", target)               # zoo/weights/msd, shares the target's lm_head
    """
    return MsdHead.load(path, target, device=device, dtype=dtype, copy_shared=copy_shared)
