"""Weight-only int8 linear layers for the drafters' decode steps: a quarter of the bytes to read per step.

A drafter step on a CPU is a handful of matrix-vector products over one or a few tokens, and reading the weights
is what it costs: the target's verification just streamed tens of MB through the caches, so the drafter's weights
come back from memory at every block. Measured on this project's 2-core machine (a d256, 2-layer drafter, 9.4 MB
of fp32 weights), one 1-token step took 1.1 ms with cold caches and 0.42 ms warm; with int8 weights 0.69 ms cold
and 0.41 ms warm, and a 5-token block of ``massv`` drafting 5.4 -> 4.2 ms (its prompt prefill included) with the
same acceptance (reports/2026-12-07b-int8-drafting-linux-x86_64-2c/int8_ab).

Each output row of a weight ``W [N, K]`` is kept as int8 with one scale, ``W[n] ~= scale[n] * Wq[n]`` (symmetric,
``scale = max |W[n]| / 127``), and multiplied by torch's weight-only int8 kernel (``torch._weight_int8pack_mm``,
the kernel gpt-fast's int8 mode uses) with bf16 activations, the kernel's fast path; results come back in the
caller's dtype. Rows are independent, so the fused weights of ``lean_llama`` (q|k|v, gate|up) quantize to exactly
what their parts would.

Lossless either way: only the drafter's weights change, so only what it proposes (and the law ``q`` it drew
from) changes, never what the target accepts. A drafter that trains keeps its fp32 weights; the int8 copy is
derived from them and rebuilt when they change (``packed`` in ``lean_llama``).

    w8 = quantize(weight)      # weight [N, K] fp32 -> Int8Weight
    y = w8(x)                  # x [..., K] -> [..., N] in x's dtype, ~= F.linear(x, weight)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

MODES = ("auto", "int8", "none")
K_MULTIPLE = 16  # the kernel's inner dimension must be a multiple of this (others crash the process on CPU)
# nn.Linear -> (key of the weight it was quantized from, its Int8Weight): ``linear``'s copies, never on the module
_HELD: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Int8Weight]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Int8Weight:
    """``weight`` [N, K] int8 and ``scales`` [N] bf16: ``W[n] ~= scales[n] * weight[n]``."""

    weight: torch.Tensor  # [N, K] int8, contiguous
    scales: torch.Tensor  # [N] bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        lead, k = x.shape[:-1], x.shape[-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), self.weight, self.scales)  # [M, N] bf16
        return y.to(x.dtype).reshape(*lead, self.weight.shape[0])


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` over an int8 copy of its weight (plus its float bias): x [..., K] -> [..., N] in x's dtype.

    The copy is made on first use and again when the weight is replaced, moved or changed in place; it is kept in a
    side table (weakly keyed by the module), so a module shared with the target (the lm_head an EAGLE-style head
    reads) is left as it is. A weight the kernel does not take (``fits``) is multiplied as it is."""
    w = module.weight
    if not fits(w):
        return module(x)
    key = (w.data_ptr(), w._version, w.device)
    held = _HELD.get(module)
    if held is None or held[0] != key:
        held = (key, quantize(w))
        _HELD[module] = held
    y = held[1](x)  # [..., N]
    return y if module.bias is None else y + module.bias


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight [N, K]: K a multiple of ``K_MULTIPLE`` (torch 2.13's CPU kernel
    crashes the process on any other K, so this is checked before a weight is ever quantized)."""
    return weight.dim() == 2 and weight.shape[1] > 0 and weight.shape[1] % K_MULTIPLE == 0


def quantize(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] float -> its per-row symmetric int8 copy (``fits(weight)`` required)."""
    if not fits(weight):
        raise ValueError(f"int8 weights need [N, K] with K a multiple of {K_MULTIPLE}, got {tuple(weight.shape)}")
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [N, K]
    return Int8Weight(q, scales.to(torch.bfloat16))


def resolve(mode: str, device: torch.device | str, who: str) -> bool:
    """Whether a drafter on ``device`` drafts with int8 weights: ``mode`` "int8" (an error where the kernel does not
    run), "none", or "auto" (int8 on a CPU whose torch runs the kernel: there a step is memory-bound; elsewhere the
    weights stay as they are)."""
    if mode not in MODES:
        raise ValueError(f"{who}: quantize must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return False
    dev = torch.device(device)
    if mode == "auto" and dev.type != "cpu":
        return False
    if not kernel_runs(dev.type):
        if mode == "int8":
            raise ValueError(f"{who}: quantize 'int8' needs torch._weight_int8pack_mm on {dev.type}, which this "
                             "torch does not run; use 'none'")
        return False
    return True


@lru_cache(maxsize=None)
def kernel_runs(device_type: str) -> bool:
    """Whether torch's weight-only int8 kernel runs on this device type and agrees with a float product."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(16, 32, generator=g).to(device_type)
        x = torch.randn(3, 32, generator=g).to(device_type)
        got = quantize(w)(x)  # [3, 16]
        return bool(torch.allclose(got, x @ w.t(), rtol=0.05, atol=0.1))
    except Exception:  # noqa: BLE001 - a probe: any failure (no kernel, no such device, a build without it) is a no
        return False
