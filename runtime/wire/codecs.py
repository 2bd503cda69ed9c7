"""Codec names, the dtypes that may cross the wire, and codec negotiation.

A codec name is ``<base>`` or ``<base>+<compression>``:

    base         what the tensor becomes on the wire                   lossless for
    raw          its own dtype, bytes as they are                     every dtype
    fp32         float32                                              float32, float16, bfloat16
    fp16         float16                                              float16
    bf16         bfloat16                                             bfloat16
    int8         int8, row-wise symmetric over the last dim, + scales  nothing (|err| <= scale / 2 per element)
    compression  lz4 (frame format) or zstd, both lossless, checksummed

fp16 turns |x| > 65504 into inf like any cast (use bf16 for wide-range values). Float bases apply to
floating-point tensors only; integer and bool tensors always travel ``raw`` (with the
negotiated compression). Every peer decodes ``raw``, so negotiation only picks the float codec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import WireError

# Names in headers -> torch dtypes. Nothing else is ever built from a header (no object arrays, no pickle).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
SCALE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}  # int8 scales

BASES = ("raw", "fp32", "fp16", "bf16", "int8")
COMPRESSIONS = ("lz4", "zstd")
BASE_WIRE_DTYPE: dict[str, torch.dtype | None] = {  # None: the tensor's own dtype
    "raw": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
}
CODECS = tuple(b if c is None else f"{b}+{c}" for b in BASES for c in (None, *COMPRESSIONS))


@dataclass(frozen=True)
class Codec:
    base: str  # one of BASES
    compression: str | None  # one of COMPRESSIONS, or None

    @property
    def name(self) -> str:
        return self.base if self.compression is None else f"{self.base}+{self.compression}"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the (uncompressed) data on the wire for a tensor of ``dtype``."""
        wire = BASE_WIRE_DTYPE[self.base]
        return dtype if wire is None else wire

    def check_dtype(self, dtype: torch.dtype) -> None:
        if self.base != "raw" and dtype not in FLOAT_DTYPES:
            raise WireError(f"codec {self.name!r} needs a floating-point tensor, got {DTYPE_NAMES.get(dtype, dtype)}")

    def is_lossless(self, dtype: torch.dtype) -> bool:
        """Whether decoding gives back exactly the values of a ``dtype`` tensor."""
        if self.base == "raw":
            return True
        if self.base == "fp32":
            return dtype in (torch.float32, torch.float16, torch.bfloat16)
        return (self.base, dtype) in (("fp16", torch.float16), ("bf16", torch.bfloat16))

    def for_dtype(self, dtype: torch.dtype) -> Codec:
        """The codec a tensor of ``dtype`` actually uses: non-float tensors travel raw, same compression."""
        return self if dtype in FLOAT_DTYPES else Codec("raw", self.compression)


def parse_codec(name: object) -> Codec:
    """``"int8+zstd"`` -> ``Codec("int8", "zstd")``; anything else than the names in ``CODECS`` is a WireError."""
    if not isinstance(name, str):
        raise WireError(f"codec must be a string, got {type(name).__name__}")
    base, sep, compression = name.partition("+")
    if base not in BASES or (sep and compression not in COMPRESSIONS):
        raise WireError(f"unknown codec {name[:40]!r}; known: {', '.join(CODECS)}")
    return Codec(base, compression if sep else None)


def negotiate_codec(accepted: Sequence[str], preference: Sequence[str]) -> str:
    """The first codec in the server's ``preference`` that the drafter ``accepted``; WireError if none is shared.

    The server (verifier) knows its bandwidth and the drafter's tolerance for lossy features, so its order wins;
    the drafter only says what it can decode. Unknown names in either list are an error, not silently skipped.

        >>> negotiate_codec(["fp16", "fp32"], ["int8+zstd", "fp16", "fp32"])
        'fp16'
    """
    acc = {parse_codec(c).name for c in accepted}
    prefs = [parse_codec(c).name for c in preference]
    for name in prefs:
        if name in acc:
            return name
    raise WireError(f"no codec in common: drafter accepts {sorted(acc)}, server prefers {prefs}")
