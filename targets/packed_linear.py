"""CPU linear layers through oneDNN on a prepacked weight.

PyTorch runs a CPU ``nn.Linear`` through MKL's sgemm. On this project's machine (an AMD EPYC with AVX-512) that
sgemm runs a generic path: a verify block of 6 rows costs 3x one row, and a prefill of 158 rows multiplies at
~210 GFLOP/s. oneDNN, which PyTorch also ships, multiplies the same fp32 numbers against a weight reordered once
into its blocked layout at ~460 GFLOP/s, and 2-9 rows cost about what one row does (``bench target`` shows
``T_verify(gamma) / T_decode`` and the prefill's matmul rate).

``pack_linears(model)`` gives every eligible ``nn.Linear`` of a model its packed copy and swaps the module's class
to ``PackedLinear`` (parameters, hooks, state-dict keys and ``isinstance`` unchanged). Its forward uses the packed
copy when the input sits on the CPU in the weight's dtype and needs no gradient; otherwise (another device, a
weight changed since packing, autograd) it is the stock ``F.linear``. One-row inputs are packed too: alone with warm
caches MKL's matrix-vector kernel is as fast, but inside the model (weights back from memory after every layer)
decoding measured 10% faster packed. Results are fp32 (bf16) products of the same numbers, rounded in another
order: like any change of kernel or batch size, not bit-identical to MKL's, and exactly as lossless (verify and
plain decoding share it).

The packed copies cost the linear weights' memory once more, so ``auto`` packs only models whose linear weights
fit ``AUTO_MAX_BYTES``. Packed copies live in a side table, not on the module: ``copy.deepcopy`` and
``state_dict`` see a plain linear (a deep copy runs unpacked).

Drafters keep their kernels: their one-row steps read int8 weights (``drafters/int8_weights.py``), and packing
their float linears measured no faster (draft ms per block within noise for flash, massv, msd and text_lm).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

AUTO_MAX_BYTES = 1 << 30  # linear weights up to 1 GiB are packed by default (their copies cost as much again)
_DTYPES = (torch.float32, torch.bfloat16)
_ROW_HINT = 8  # oneDNN's batch hint for the reorder; measured: the same speed at 2-600 rows as a hint of 158
# module -> (key of the weight and bias it was packed from, packed weight)
_PACKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]] = weakref.WeakKeyDictionary()


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear ops."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def _key(module: nn.Linear) -> tuple:
    w, b = module.weight, module.bias
    return (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies several CPU rows through oneDNN on its packed weight (see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        entry = _PACKS.get(self)
        if (entry is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and entry[0] == _key(self)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return torch.ops.mkldnn._linear_pointwise(x, entry[1], self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def cpu_linear_bytes(model: nn.Module) -> int:
    """Bytes of the CPU weights of ``model``'s ``nn.Linear`` layers (a weight shared by several counted once)."""
    seen = {}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.device.type == "cpu":
            seen[m.weight.data_ptr()] = m.weight.numel() * m.weight.element_size()
    return sum(seen.values())


def wanted(model: nn.Module, setting: bool | None) -> bool:
    """``setting`` True / False, or None for auto: CPU linear weights that fit ``AUTO_MAX_BYTES`` (and some)."""
    if setting is not None:
        return bool(setting)
    return available() and 0 < cpu_linear_bytes(model) <= AUTO_MAX_BYTES


def pack_linears(model: nn.Module) -> int:
    """Pack every plain CPU ``nn.Linear`` of ``model`` in float32 / bfloat16; returns how many were packed.

    Idempotent: packing again repacks from the current weights (after an in-place change, say)."""
    if not available():
        return 0
    count = 0
    with torch.no_grad():
        for m in model.modules():
            if type(m) not in (nn.Linear, PackedLinear):
                continue  # subclasses (quantized, LoRA, ...) keep their own forward
            w = m.weight
            if w.device.type != "cpu" or w.dtype not in _DTYPES or (m.bias is not None and m.bias.dtype != w.dtype):
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROW_HINT)
            _PACKS[m] = (_key(m), packed)
            m.__class__ = PackedLinear
            count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears``: plain ``nn.Linear`` again, packed copies freed; returns how many were unpacked."""
    count = 0
    for m in model.modules():
        if type(m) is PackedLinear:
            _PACKS.pop(m, None)
            m.__class__ = nn.Linear
            count += 1
    return count


def packed_count(model: nn.Module) -> int:
    """How many of ``model``'s linears hold a packed copy."""
    return sum(1 for m in model.modules() if type(m) is PackedLinear and m in _PACKS)
