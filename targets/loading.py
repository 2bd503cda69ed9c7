"""``load_target``: pick the backend from the HF config's model_type and wrap a model or a local checkpoint."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoConfig

from .hf_target import HFTarget
from .kv import KVPolicy
from .llava import LlavaTarget
from .qwen2_5_vl import Qwen2_5_VLTarget

BACKENDS: dict[str, type[HFTarget]] = {"llava": LlavaTarget, "qwen2_5_vl": Qwen2_5_VLTarget}


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'float16', 'bfloat16'")
    return value


def _backend(model_type: str) -> type[HFTarget]:
    if model_type not in BACKENDS:
        raise ValueError(f"no target backend for model_type {model_type!r}; supported: {sorted(BACKENDS)}")
    return BACKENDS[model_type]


def load_target(
    path_or_model: str | os.PathLike | nn.Module,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    feature_layers: Sequence[int] = (),
    kv_policy: KVPolicy = KVPolicy(),
    attn_implementation: str = "sdpa",
    packed_linears: bool | None = None,
) -> HFTarget:
    """A Target over a local HF checkpoint directory (no hub access, no remote code) or a model instance.

    ``dtype=None`` keeps the checkpoint's (or the instance's) dtype. A model instance is moved in place.
    ``feature_layers`` are HF hidden-state indices returned with every prefill/verify (e.g. EAGLE-3's
    low/mid/high layers: ``(2, n // 2, n - 3)``). ``packed_linears``: run the linear layers through oneDNN on
    prepacked weights (``targets/packed_linear.py``); None = auto (a CPU model whose linear weights fit 1 GiB).

        target = load_target("/models/llava-1.5-7b-hf", device="cuda:0", dtype="float16")
    """
    dt = _dtype(dtype)
    if isinstance(path_or_model, nn.Module):
        model = path_or_model
        backend = _backend(model.config.model_type)
        if dt is not None:
            model.to(dt)
    else:
        path = os.fspath(path_or_model)
        if not os.path.isdir(path):
            raise ValueError(f"target checkpoint {path!r} is not a local directory")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        backend = _backend(config.model_type)
        model = backend.hf_class.from_pretrained(
            path,
            dtype=dt if dt is not None else "auto",
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
    return backend(model, device=device, feature_layers=feature_layers, kv_policy=kv_policy,
                   packed_linears=packed_linears)
