"""One tensor <-> (msgpack-able header, payload bytes). Decoding validates every field before allocating anything.

Header (all keys required; the last two only, and always, for int8)::

    {"dtype": "float32",         # the tensor's dtype; decoding returns it (unless asked for another)
     "shape": [2, 8, 16, 64],    # rank <= MAX_RANK, every dim in [0, MAX_DIM]
     "codec": "int8+zstd",       # see codecs.py
     "raw_nbytes": 18432,        # uncompressed body: numel * wire itemsize (+ scale_count * scale itemsize)
     "payload_nbytes": 9101,     # bytes that follow on the wire (== raw_nbytes when uncompressed)
     "scale_dtype": "float16",   # int8: dtype of the row scales
     "scale_count": 256}         # int8: rows = numel / shape[-1] (0 for an empty tensor, 1 for a scalar)

Body: little-endian, C order. int8 bodies are the scales [rows] followed by the int8 values [rows, D] (scales
first keeps them aligned).

Decoding allocates, after validation, at most ``raw_nbytes`` (decompressed body) + ``numel * wire itemsize`` +
the output tensor, plus a 4 MiB int8 working set; ``raw_nbytes`` and the output size are each <= ``max_bytes``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

from .codecs import DTYPE_NAMES, DTYPES, SCALE_DTYPES, Codec, parse_codec
from .compress import compress, decompress
from .errors import WireError
from .quant import dequantize_rows, quantize_rows

if sys.byteorder != "little":  # the body is the tensor's memory as is
    raise ImportError("specula.runtime.wire assumes a little-endian host")

MAX_RANK = 8
MAX_DIM = 1 << 40  # a dim bound that holds even when another dim is 0 (numel 0 says nothing about the others)
_KEYS = frozenset({"dtype", "shape", "codec", "raw_nbytes", "payload_nbytes"})
_INT8_KEYS = frozenset({"scale_dtype", "scale_count"})


@dataclass(frozen=True)
class TensorSpec:
    """A validated header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: Codec
    raw_nbytes: int
    payload_nbytes: int
    numel: int
    rows: int  # int8 scale rows, else 0
    scale_dtype: torch.dtype | None  # int8 only


def encode_tensor(
    t: torch.Tensor, codec: str = "fp32", *, scale_dtype: torch.dtype = torch.float32, level: int | None = None
) -> tuple[dict, bytes]:
    """Encode ``t`` (any device, any layout) as ``codec``; returns (header, payload). ``level``: compression level.

        >>> header, payload = encode_tensor(torch.ones(2, 3), "fp16+lz4")
        >>> header["raw_nbytes"], header["codec"]
        (12, 'fp16+lz4')
    """
    if not isinstance(t, torch.Tensor):
        raise WireError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {t.dtype} cannot cross the wire; known: {', '.join(DTYPES)}")
    if t.layout != torch.strided:
        raise WireError(f"only dense (strided) tensors cross the wire, got {t.layout}")
    if t.dim() > MAX_RANK:
        raise WireError(f"rank {t.dim()} exceeds MAX_RANK={MAX_RANK}")
    c = parse_codec(codec)
    c.check_dtype(t.dtype)
    x = t.detach().cpu()
    header: dict = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(x.shape), "codec": c.name}
    if c.base == "int8":
        q, scales = quantize_rows(x, scale_dtype)  # [R, D] int8, [R]
        raw = _as_bytes(scales) + _as_bytes(q)
        header.update(scale_dtype=DTYPE_NAMES[scales.dtype], scale_count=scales.numel())
    else:
        raw = _as_bytes(x.to(c.wire_dtype(x.dtype)))
    payload = raw if c.compression is None else compress(raw, c.compression, level)
    header.update(raw_nbytes=len(raw), payload_nbytes=len(payload))
    return _ordered(header), payload


def validate_header(header: object, *, max_bytes: int) -> TensorSpec:
    """Check a header against itself and ``max_bytes`` (pure arithmetic on Python ints: nothing is allocated)."""
    if not isinstance(header, dict):
        raise WireError(f"tensor header must be a map, got {type(header).__name__}")
    if "codec" not in header:
        raise WireError("tensor header has no 'codec'")
    keys = set(header)
    codec = parse_codec(header["codec"])
    want = _KEYS | (_INT8_KEYS if codec.base == "int8" else frozenset())
    if keys != want:
        missing, extra = sorted(want - keys, key=str), sorted(keys - want, key=str)
        raise WireError(f"tensor header keys: missing {missing}, unexpected {[str(k)[:32] for k in extra]}")
    name = header["dtype"]
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"unknown dtype {_show(name)}; known: {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    codec.check_dtype(dtype)
    shape = header["shape"]
    if not isinstance(shape, (list, tuple)):
        raise WireError(f"shape must be a list of ints, got {type(shape).__name__}")
    if len(shape) > MAX_RANK:
        raise WireError(f"shape rank {len(shape)} exceeds MAX_RANK={MAX_RANK}")
    for d in shape:
        if not _is_int(d) or not 0 <= d <= MAX_DIM:
            raise WireError(f"shape {_short(shape)} has an invalid dim {_show(d)} (ints in [0, {MAX_DIM}])")
    numel = math.prod(shape)
    wire_item = codec.wire_dtype(dtype).itemsize
    out_nbytes = numel * dtype.itemsize
    rows, sdtype, expected = 0, None, numel * wire_item
    if codec.base == "int8":
        sname, count = header["scale_dtype"], header["scale_count"]
        if not isinstance(sname, str) or sname not in SCALE_DTYPES:
            raise WireError(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {_show(sname)}")
        sdtype = SCALE_DTYPES[sname]
        rows = 0 if numel == 0 else numel // (shape[-1] if shape else 1)
        if not _is_int(count) or count != rows:
            raise WireError(f"scale_count {_show(count)} does not match {rows} rows of shape {_short(shape)}")
        expected += rows * sdtype.itemsize
    raw, pay = header["raw_nbytes"], header["payload_nbytes"]
    for key, v in (("raw_nbytes", raw), ("payload_nbytes", pay)):
        if not _is_int(v) or v < 0:
            raise WireError(f"{key} must be a non-negative int, got {_show(v)}")
    if raw != expected:
        raise WireError(f"raw_nbytes={raw} but shape {_short(shape)} as {codec.name} of {name} needs {expected}")
    if max(raw, out_nbytes) > max_bytes:
        raise WireError(f"tensor of shape {_short(shape)} needs {max(raw, out_nbytes)} bytes > max_bytes={max_bytes}")
    if codec.compression is None and pay != raw:
        raise WireError(f"uncompressed payload_nbytes={pay} != raw_nbytes={raw}")
    if codec.compression is not None and pay > raw + raw // 128 + 1024:  # lz4/zstd worst-case expansion is below
        raise WireError(f"payload_nbytes={pay} is more than {codec.compression} can expand raw_nbytes={raw} to")
    return TensorSpec(dtype, tuple(shape), codec, raw, pay, numel, rows, sdtype)


def decode_tensor(
    header: object,
    payload: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Validate, then decode to a tensor on ``device`` in ``dtype`` (default: the header's). WireError if invalid."""
    spec = validate_header(header, max_bytes=max_bytes)
    view = memoryview(payload).cast("B")
    if len(view) != spec.payload_nbytes:
        raise WireError(f"payload is {len(view)} bytes, header declares payload_nbytes={spec.payload_nbytes}")
    c = spec.codec
    raw = view if c.compression is None else memoryview(decompress(view, c.compression, spec.raw_nbytes))
    out_dtype = spec.dtype if dtype is None else dtype
    if c.base == "int8":
        scales = _from_bytes(raw[: spec.rows * spec.scale_dtype.itemsize], spec.scale_dtype)  # [R]
        q = _from_bytes(raw[spec.rows * spec.scale_dtype.itemsize:], torch.int8)  # [R * D]
        d = spec.numel // spec.rows if spec.rows else 0
        out = torch.empty(spec.rows, d, dtype=out_dtype)  # [R, D]
        t = dequantize_rows(q.view(spec.rows, d), scales, out).reshape(spec.shape)
    else:
        t = _from_bytes(raw, c.wire_dtype(spec.dtype)).reshape(spec.shape).to(out_dtype)
    return t.to(device)


def _from_bytes(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """Copy ``buf`` into a new 1-D tensor (owned and writable, unlike torch.frombuffer on immutable bytes)."""
    t = torch.empty(len(buf) // dtype.itemsize, dtype=dtype)
    t.view(torch.uint8).numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return t


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _short(shape: object) -> str:
    s = str(list(shape)) if isinstance(shape, (list, tuple)) else str(shape)
    return s if len(s) <= 80 else s[:77] + "..."


def _ordered(header: dict) -> dict:
    order = ("dtype", "shape", "codec", "raw_nbytes", "payload_nbytes", "scale_dtype", "scale_count")
    return {k: header[k] for k in order if k in header}
