"""Lane snapshots: a training lane's weights kept in the repository as a small delta against the shipped target.

``runs/`` is not committed, and a new session's checkout has lost it six times: every time the lane's hours of CPU
went with it and the next session started again from the shipped weights. A
full fp16 export of a lane is 35 MB per copy in git's history; most of its tensors (the frozen tower and projector)
equal the shipped ones anyway. A snapshot stores only what moved:

- for every tensor of the checkpoint's model (rounded to fp16, as ``zoo export`` would store it) that differs from the
  base model's, the difference, as int8 per row with one fp16 scale a row (``max |delta| / 127``): 1-D tensors
  (norm gains, biases) keep their delta in fp16, and so does any tensor whose int8 rows would miss it by more than
  ``INT8_TOL`` (rows rewritten outright by a fit); tensors equal to the base's are not stored; a tied tensor once;
- ``lane.json``: the base (its path as given and the sha256 of its weights file, which a restore checks), the
  checkpoint's ``state.json`` (samples, elapsed time, history, the run's config: what ``--init-from`` and ``zoo eval
  --checkpoint`` read), the largest rounding error of the int8 deltas, and a free-text note (the lane's command).

``restore`` writes a training-checkpoint directory (fp32 ``model.safetensors`` + ``state.json``), so the lane goes on
with ``specula train target --init-from <dir>`` (the optimizer restarts with its short warm-up, as from any export)
and reads with ``specula zoo eval --checkpoint`` / ``python -m research probe-sets --checkpoint``. The weights come
back within the recorded rounding error of the checkpoint's, not bit for bit: a snapshot is a place to go on from,
never weights to ship.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DELTA_FILE, INFO_FILE = "delta.safetensors", "lane.json"
SCALE_SUFFIX = "::scale"


def _base_weights(base: Path) -> Path:
    path = base / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{base}: not an exported model (no model.safetensors)")
    return path


def _state_dict(model) -> dict[str, torch.Tensor]:
    """A model's tensors by name, each tied tensor under its first name only, fp32 on the CPU."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().float().cpu()
    return out


def quantize(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and their fp16 scales: delta # [R, ...] -> q # [R, ...] int8, scale # [R] fp16."""
    rows = delta.reshape(delta.shape[0], -1)  # [R, C]
    scale = (rows.abs().amax(-1) / 127.0).to(torch.float16).float()  # [R]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / safe[:, None]).round().clamp(-127, 127).to(torch.int8)  # [R, C]
    return q.reshape(delta.shape), scale.to(torch.float16)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of ``quantize``: # [R, ...] fp32."""
    shape = [q.shape[0]] + [1] * (q.dim() - 1)
    return q.float() * scale.float().reshape(shape)


INT8_TOL = 1e-3  # a tensor whose int8 rows would miss its delta by more than this is stored in fp16 instead


def pack(delta: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    """One tensor's delta as stored (under "" and, for int8 rows, SCALE_SUFFIX) and its largest rounding error:
    fp16 for 1-D tensors and for any tensor whose int8 rows would miss by more than ``INT8_TOL`` (a row rewritten
    outright, as ``--set-count-key-fit`` does, has a delta far larger than training's drift), int8 rows otherwise."""
    if delta.dim() > 1:
        q, scale = quantize(delta)
        err = float((dequantize(q, scale) - delta).abs().max())
        if err <= INT8_TOL:
            return {"": q, SCALE_SUFFIX: scale}, err
    half = delta.to(torch.float16)
    return {"": half}, float((half.float() - delta).abs().max())


def save(ckpt: Path, base: Path, out: Path, note: str = "") -> dict:
    """Snapshot the training checkpoint ``ckpt`` against the exported model ``base`` into ``out``; returns lane.json."""
    from safetensors.torch import save_file

    from specula.training.target.evaluate import load_checkpoint, load_model
    from specula.zoo.store import sha256

    model, _, state = load_checkpoint(str(ckpt))  # every weight rounded to fp16, as an export stores it
    ref, _ = load_model(str(base))
    mine, theirs = _state_dict(model), _state_dict(ref)
    if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
        raise ValueError(f"{ckpt} and {base} are not the same architecture")
    tensors: dict[str, torch.Tensor] = {}
    worst = 0.0
    for name, w in mine.items():
        delta = w - theirs[name]
        if not bool(delta.any()):
            continue
        packed, err = pack(delta)
        tensors.update({name + suffix: t for suffix, t in packed.items()})
        worst = max(worst, err)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / DELTA_FILE))
    stored = sum(1 for k in tensors if not k.endswith(SCALE_SUFFIX))
    info = {"base": str(base), "base_sha256": sha256(_base_weights(base)), "tensors_stored": stored,
            "tensors_same": len(mine) - stored, "max_abs_error": worst, "note": note, "state": state}
    (out / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return info


def restore(snapshot: Path, out: Path, base: Path | None = None) -> Path:
    """Rebuild a snapshot's checkpoint into ``out`` (fp32 ``model.safetensors`` + ``state.json``); ``base``
    defaults to the recorded one and must be the very weights the snapshot was taken against."""
    from safetensors.torch import load_file, save_file

    from specula.training.target.evaluate import load_model
    from specula.zoo.store import sha256

    info_path = snapshot / INFO_FILE
    if not info_path.exists() or not (snapshot / DELTA_FILE).exists():
        raise FileNotFoundError(f"{snapshot}: not a lane snapshot (needs {INFO_FILE} and {DELTA_FILE})")
    info = json.loads(info_path.read_text())
    base = Path(base or info["base"])
    got = sha256(_base_weights(base))
    if got != info["base_sha256"]:
        raise ValueError(f"{base}: its weights (sha256 {got[:12]}) are not the ones {snapshot} was taken against "
                         f"({info['base_sha256'][:12]})")
    if (out / "state.json").exists():
        raise ValueError(f"{out} already holds a checkpoint; restore into a new directory")
    model, _ = load_model(str(base))
    weights = _state_dict(model)
    delta = load_file(str(snapshot / DELTA_FILE))
    for name, d in delta.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if name not in weights:
            raise ValueError(f"{snapshot}: tensor {name!r} is not in {base}")
        add = d.float() if d.dtype != torch.int8 else dequantize(d, delta[name + SCALE_SUFFIX])
        if add.shape != weights[name].shape:
            raise ValueError(f"{snapshot}: tensor {name!r} has shape {tuple(add.shape)}, the base's is "
                             f"{tuple(weights[name].shape)}")
        weights[name] = weights[name] + add
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "state.json").write_text(json.dumps(info["state"], indent=1) + "\n")
    return out


def lane_cli(args) -> int:
    if args.action == "save":
        info = save(Path(args.ckpt), Path(args.base), Path(args.out), note=args.note or "")
        size = (Path(args.out) / DELTA_FILE).stat().st_size
        print(f"saved {args.ckpt} ({info['state'].get('samples', 0)} samples) -> {args.out}: "
              f"{info['tensors_stored']} tensors moved, {info['tensors_same']} as the base's, {size / 1e6:.1f} MB, "
              f"largest rounding error {info['max_abs_error']:.2e}")
    else:
        out = restore(Path(args.snapshot), Path(args.out), Path(args.base) if args.base else None)
        print(f"restored {args.snapshot} -> {out}: go on with `specula train target --init-from {out} ...`")
    return 0
