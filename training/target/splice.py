"""``specula zoo splice``: a training checkpoint whose LM comes from one run and whose vision side (tower and
projector) comes from other weights.

Why: a joint stage that trains the tower slowly through a fixed projector lets the tower drift from what the LM
first learnt to read (the scan-caption run's code loss rose 0.028 -> 0.06); putting the shipped tower and
projector back under that run's LM raised its caption recall 0.72 -> 0.80 and VQA 0.83 -> 0.88 on 300 held-out
samples (zoo/TRAINING.md, "The tower drift"). The spliced checkpoint resumes like any other (state, optimizer and
vision heads are copied from the LM's run; ``--freeze-vision`` then keeps the new vision side as it is).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def _vision_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Vision tower + projector weights (fp32) of an exported model directory or a training checkpoint."""
    from safetensors.torch import load_file

    if (src / "state.json").exists() and (src / "model.safetensors").exists():  # a training checkpoint
        sd = load_file(src / "model.safetensors")
    elif (src / "config.json").exists():  # an exported model (fp16 safetensors, HF layout)
        from transformers import LlavaForConditionalGeneration

        sd = LlavaForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).state_dict()
    else:
        raise FileNotFoundError(f"{src}: neither a training checkpoint (state.json + model.safetensors) nor an "
                                "exported model (config.json)")
    out = {k: v.float().contiguous() for k, v in sd.items() if k.startswith(VISION_PREFIXES)}
    if not out:
        raise ValueError(f"{src}: no vision tower or projector weights")
    return out


def splice(ckpt: Path, vision_from: Path, out: Path) -> int:
    """Write ``out``: a copy of checkpoint ``ckpt`` with every vision tower and projector tensor taken from
    ``vision_from``. Returns the number of tensors replaced. Shapes must match; ``out`` must not exist."""
    from safetensors.torch import load_file

    if not (ckpt / "state.json").exists() or not (ckpt / "model.safetensors").exists():
        raise FileNotFoundError(f"{ckpt}: not a training checkpoint (needs state.json and model.safetensors)")
    if out.exists():
        raise FileExistsError(f"{out} exists; splice writes a new checkpoint directory")
    sd = load_file(ckpt / "model.safetensors")
    vision = _vision_tensors(vision_from)
    mine = {k for k in sd if k.startswith(VISION_PREFIXES)}
    if mine != set(vision):
        missing, extra = sorted(mine - set(vision)), sorted(set(vision) - mine)
        raise ValueError(f"{vision_from}: vision weights do not match {ckpt}'s (missing {missing[:3]}, extra "
                         f"{extra[:3]})")
    for k, v in vision.items():
        if sd[k].shape != v.shape:
            raise ValueError(f"{k}: shape {tuple(v.shape)} in {vision_from}, {tuple(sd[k].shape)} in {ckpt}")
        sd[k] = v
    at = json.loads((ckpt / "state.json").read_text()).get("samples", 0)
    write_copy(ckpt, out, sd, "splices", {"lm_from": str(ckpt), "vision_from": str(vision_from), "at_samples": at})
    return len(vision)


def write_copy(ckpt: Path, out: Path, sd: dict[str, torch.Tensor], key: str, record: dict) -> None:
    """Write ``out`` as a copy of checkpoint ``ckpt`` (state, optimizers, vision heads) with weights ``sd`` and
    ``record`` appended to the state's list ``key``; written beside ``out`` and renamed into place."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    save_file(sd, tmp / "model.safetensors")
    state = json.loads((tmp / "state.json").read_text())
    state.setdefault(key, []).append(record)
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)


def splice_cli(args) -> int:
    n = splice(Path(args.ckpt), Path(args.vision_from), Path(args.out))
    print(f"{args.out}: the LM of {args.ckpt} with {n} vision tensors from {args.vision_from}")
    return 0
