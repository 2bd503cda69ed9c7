"""int8 row-wise symmetric quantization over the last dim (for drafter-bound features only: it is lossy).

Each row r of ``x.reshape(-1, D)`` gets ``scale[r] = max|x[r]| / 127`` and ``q = round(x / scale)`` in [-127, 127];
decoding gives ``q * scale``, so every element is within ``scale[r] / 2`` of the input. Scales may be stored as
fp16 to halve their cost; they are then rounded *up* (never down), so ``|x| / scale <= 127`` still holds and the
bound stays ``stored_scale / 2``. Rows whose scale fp16 cannot hold with full precision (above 65504, or nonzero
below fp16's smallest normal 2**-14) make the whole tensor fall back to fp32 scales; the header says which.

    >>> q, s = quantize_rows(torch.tensor([[1.0, -0.5], [0.0, 0.0]]), torch.float32)
    >>> q.tolist(), s.tolist()
    ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
"""

from __future__ import annotations

import torch

from .errors import WireError

_FP16_MIN_NORMAL = 2.0**-14
_FP16_MAX = 65504.0
_DEQUANT_BLOCK = 1 << 20  # elements dequantized at a time: bounds the fp32 working set to 4 MiB


def quantize_rows(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] float -> (q [R, D] int8, scales [R] in ``scale_dtype`` or fp32 on fallback), R = numel / D."""
    d = x.shape[-1] if x.dim() else 1
    rows = x.numel() // d if x.numel() else 0
    x2 = x.reshape(rows, d).float()  # [R, D] fp32
    scale = x2.abs().amax(dim=1) / 127.0 if rows else x2.new_zeros(0)  # [R] fp32
    if not bool(torch.isfinite(scale).all()):
        raise WireError("int8 codec needs finite values (found inf or nan); use fp16/bf16/fp32 for this tensor")
    if scale_dtype == torch.float16:
        nonzero = scale[scale > 0]
        if nonzero.numel() and (nonzero.min() < _FP16_MIN_NORMAL or nonzero.max() > _FP16_MAX / 1.001):
            scale_dtype = torch.float32
        else:
            s16 = scale.to(torch.float16)
            up = torch.nextafter(s16, torch.full_like(s16, float("inf")))
            scale = torch.where(s16.float() < scale, up, s16)  # [R] fp16, >= the exact scale
    elif scale_dtype != torch.float32:
        raise WireError(f"int8 scales are float32 or float16, got {scale_dtype}")
    stored = scale.to(scale_dtype)  # [R]
    divisor = torch.where(stored > 0, stored.float(), torch.ones_like(scale, dtype=torch.float32))  # [R] fp32
    q = torch.round(x2 / divisor[:, None]).clamp_(-127, 127).to(torch.int8)  # [R, D]
    return q, stored


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``q`` [R, D] int8, ``scales`` [R] -> ``out`` [R, D] (any float dtype), computed in fp32 a block at a time."""
    rows, d = q.shape
    step = max(1, _DEQUANT_BLOCK // max(d, 1))
    s = scales.float()  # [R] fp32
    for r0 in range(0, rows, step):
        out[r0:r0 + step] = q[r0:r0 + step].float() * s[r0:r0 + step, None]
    return out
