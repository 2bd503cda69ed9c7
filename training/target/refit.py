"""``specula zoo refit-projector``: a training checkpoint whose projector is fitted again, in closed form, onto word
codes that also carry a code of its own for each layout cell.

Why: a scan caption's object phrase is a lookup by place, and an object token holds its place as the sum of its
place words ("bottom left" = code(bottom) + code(left), "bottom" = code(bottom)). One attention head that finds
nothing at an empty "bottom left" must score the "bottom" and "left" objects below the zero background, and then it
scores the "bottom left" object, their sum, below zero too; half of the objects the scan captions put in the wrong
cell came from a cell that shares a place word (zoo/TRAINING.md, "What a cell's phrase gets wrong, and captions by
colour"). With
``cell_codes`` = w every object patch's target code gains w * code("<cell bottom left>"), one direction per cell.
The projector fit is a ridge regression that fits each output direction on its own (training/target/projector_fit.py), so the
refitted tokens are the old ones plus the new component, and a frozen-vision stage can teach the LM to key on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch


def refit_projector(ckpt: Path, out: Path, cell_codes: float, images: int = 960, gate: bool = True,
                    log=print, tokenizer_dir: Path | None = None) -> dict:
    """Write ``out``: a copy of training checkpoint ``ckpt`` (state, optimizers, vision heads) whose projector is
    fitted on ``images`` training images onto the run's word codes plus ``cell_codes`` x the cell codes. Returns the
    fit's record (also appended to the state's ``projector_refits``). ``out`` must not exist. ``tokenizer_dir``:
    the processor to encode with (default: the shipped tokenizer)."""
    from safetensors.torch import load_file

    from specula.targets.processor import load_processor
    from specula.training.target.batching import Encoder
    from specula.zoo.store import TOKENIZER_DIR
    from specula.training.target.projector_fit import fit_projector
    from specula.training.target.splice import write_copy
    from specula.targets.embedded_arch import TargetArch, build_model
    from specula.training.target.word_codes import WordCodes

    if cell_codes < 0:
        raise ValueError(f"cell_codes must be >= 0, got {cell_codes}")
    if not (ckpt / "state.json").exists() or not (ckpt / "model.safetensors").exists():
        raise FileNotFoundError(f"{ckpt}: not a training checkpoint (needs state.json and model.safetensors)")
    if out.exists():
        raise FileExistsError(f"{out} exists; refit-projector writes a new checkpoint directory")
    state = json.loads((ckpt / "state.json").read_text())
    cfg = state.get("config", {})
    processor = load_processor(tokenizer_dir or TOKENIZER_DIR)
    model = build_model(TargetArch.from_name(cfg["arch"]), processor.tokenizer)
    sd = load_file(ckpt / "model.safetensors")
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    codes = WordCodes(model.config.text_config.hidden_size, cfg.get("seed", 0), cell_codes=cell_codes)
    with torch.no_grad():
        fit = fit_projector(model, Encoder(processor, codes=codes), images, cfg.get("seed", 0), gate_background=gate,
                            log=log)
    proj = {k: v for k, v in model.state_dict().items() if k.startswith("model.multi_modal_projector.")}
    sd.update({k: v.float().contiguous() for k, v in proj.items()})
    record = {**asdict(fit), "cell_codes": cell_codes, "from": str(ckpt), "at_samples": state.get("samples", 0)}
    write_copy(ckpt, out, sd, "projector_refits", record)
    return record


def refit_cli(args) -> int:
    r = refit_projector(Path(args.ckpt), Path(args.out), args.cell_codes, images=args.images, gate=not args.no_gate)
    print(f"{args.out}: {args.ckpt} with its projector refitted (cell codes x{args.cell_codes}, {r['images']} images, "
          f"code loss {r['loss_before']:.4f} -> {r['loss_after']:.4f})")
    return 0
