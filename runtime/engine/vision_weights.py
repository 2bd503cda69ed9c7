"""``load_vision_target``: a Target that holds only the vision side of a checkpoint (vision tower + projector).

The VisionEncoder deployment never runs the language model, so it should not pay for it: on a 7B LLaVA the LM is
~95% of the weights. The model is built from its config on the ``meta`` device (no memory), the children of
``model.model`` other than ``language_model`` are materialized on the replica's device, and only their tensors are
read from the safetensors files (``safe_open`` reads a tensor's bytes on request, so LM shards are never touched)::

    target = load_vision_target("/models/llava-1.5-7b-hf", device="cuda", dtype="float16")
    target.encode_images(pixel_values, "projected")     # works; prefill/verify do not (the LM is on meta)

The stock HF classes are used as they are; the same backend's ``encode_images`` runs, so the features are the full
model's (tested). Non-persistent buffers (CLIP's position ids, rotary frequencies) are not in checkpoints: HF's own
``initialize_weights`` computes them, exactly as ``from_pretrained`` does after its own meta-device build.

Checkpoint key names: this transformers version keeps e.g. ``model.vision_tower.*`` in memory but saves (and
llava-hf ships) ``vision_tower.*`` or the older ``vision_tower.vision_model.*``; ``_RENAMES`` maps those, and every
vision tensor must be found exactly once with its shape, else a ``ValueError`` names the keys. A checkpoint that is
not safetensors falls back to a full load, after which the language model is dropped to ``meta``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

LANGUAGE_PARTS = ("language_model",)  # children of model.model left on meta; the top-level lm_head too
# checkpoint-key prefix -> in-memory prefix, first match wins; keys already named as in memory need no rule
_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "llava": ((r"^vision_tower\.vision_model\.", "model.vision_tower."),
              (r"^vision_tower\.", "model.vision_tower."),
              (r"^multi_modal_projector\.", "model.multi_modal_projector.")),
    "qwen2_5_vl": ((r"^visual\.", "model.visual."),),
}


def load_vision_target(path: str | os.PathLike, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                       packed_linears: bool | None = None):
    """The backend Target over ``path`` with only its vision tower and projector resident (see the module doc)."""
    from transformers import AutoConfig

    from specula.targets import BACKENDS

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"target checkpoint {str(path)!r} is not a local directory")
    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    backend = BACKENDS.get(hf.model_type)
    if backend is None:
        raise ValueError(f"no target backend for model_type {hf.model_type!r}; supported: {sorted(BACKENDS)}")
    shards = _safetensors_shards(path)
    if shards is None:
        log.warning("%s has no safetensors weights: loading the whole model, then dropping its language model", path)
        return _drop_language_model(_full_target(path, device, dtype), packed_linears)

    dt = _resolve_dtype(dtype, hf, shards)
    with torch.device("meta"):
        model = backend.hf_class._from_config(hf, dtype=dt, attn_implementation="sdpa")
    extra = {name for name, _ in model.named_children()} - {"model", "lm_head"}
    if extra:
        raise ValueError(f"{type(model).__name__} has top-level modules {sorted(extra)} this loader does not know")
    parts = {f"model.{name}": m for name, m in model.model.named_children() if name not in LANGUAGE_PARTS}
    for part in parts.values():
        part.to_empty(device=device)
    model.initialize_weights()  # non-persistent buffers of the vision parts; meta tensors are untouched
    wanted = {f"{prefix}.{key}": t for prefix, part in parts.items() for key, t in part.state_dict().items()}
    _load(wanted, shards, _RENAMES.get(hf.model_type, ()), path)
    # device=None: the LM stays on meta; target.device is the vision tower's
    return backend(model, packed_linears=packed_linears)


def resident_parameters(model: torch.nn.Module) -> int:
    """Parameters that hold memory (not on the meta device)."""
    return sum(p.numel() for p in model.parameters() if not p.is_meta)


# ----------------------------------------------------------------------------------------------- helpers


def _safetensors_shards(path: Path) -> dict[str, list[str]] | None:
    """file -> the tensor names it holds (from the index when sharded); None without safetensors weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards: dict[str, list[str]] = {}
        for key, file in json.loads(index.read_text())["weight_map"].items():
            shards.setdefault(str(path / file), []).append(key)
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {str(single): list(f.keys())}
    return None


def _resolve_dtype(dtype, hf, shards: dict[str, list[str]]) -> torch.dtype:
    """As ``from_pretrained(dtype="auto")``: the explicit dtype, else the config's, else the first float tensor's."""
    for value in (dtype, getattr(hf, "dtype", None)):
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value != "auto":
            resolved = getattr(torch, value, None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"unknown dtype {value!r}; use e.g. 'float32', 'float16', 'bfloat16'")
            return resolved
    from safetensors import safe_open

    for file, keys in shards.items():
        with safe_open(file, "pt") as f:
            for key in keys:
                t = f.get_slice(key).get_dtype()
                if t.startswith(("F", "BF")):
                    return {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}.get(t, torch.float32)
    return torch.float32


@torch.no_grad()
def _load(wanted: dict[str, torch.Tensor], shards: dict[str, list[str]], renames, path: Path) -> None:
    from safetensors import safe_open

    compiled = [(re.compile(src), dst) for src, dst in renames]

    def rename(key: str) -> str:
        for src, dst in compiled:
            if src.match(key):
                return src.sub(dst, key, count=1)
        return key

    done: set[str] = set()
    for file, keys in shards.items():
        picked = [(k, rename(k)) for k in keys if rename(k) in wanted]
        if not picked:
            continue  # a shard of language-model weights only: never opened
        with safe_open(file, "pt") as f:
            for key, name in picked:
                if name in done:
                    raise ValueError(f"{path}: two checkpoint tensors map to {name!r}")
                src, dst = f.get_tensor(key), wanted[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{path}: {key} has shape {tuple(src.shape)}, the model wants "
                                     f"{tuple(dst.shape)} for {name}")
                dst.copy_(src)  # casts to the model's dtype and moves to its device
                done.add(name)
    missing = sorted(set(wanted) - done)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks vision weights {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def _full_target(path: Path, device: str, dtype):
    from specula.targets import load_target

    return load_target(path, device=device, dtype=dtype, packed_linears=False)  # packed once the LM is dropped


def _drop_language_model(target, packed_linears: bool | None):
    from specula.targets.packed_linear import pack_linears, wanted

    model = target.model
    for name in LANGUAGE_PARTS:
        model.model.get_submodule(name).to("meta")
    model.lm_head.to("meta")
    if wanted(model, packed_linears):  # the vision tower's and projector's linears: the rest is on meta
        target.linears_packed = pack_linears(model)
    return target
