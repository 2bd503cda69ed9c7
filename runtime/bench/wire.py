"""Codec micro-benchmark: bytes on the wire, encode/decode time and error per (codec, shape), for the report.

    >>> r = bench_codecs([(1, 576, 4096)], ["fp32", "fp16", "int8+zstd"])  # doctest: +SKIP
    >>> r["int8+zstd"]["1x576x4096"]["wire_bytes"]  # doctest: +SKIP

    python -m specula.runtime.bench.wire --shapes 576x4096 8x1024x128 --codecs fp32 fp16 int8 int8+lz4

Inputs are N(0, 1) times a per-row log-normal scale (hidden states and KV have rows of very different norms, which
is what row-wise int8 scales are for). Timings are medians over ``repeats`` on whatever shares the machine; compare
ratios taken in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import msgpack
import torch

from specula.runtime.wire.codecs import parse_codec
from specula.runtime.wire.tensor import decode_tensor, encode_tensor


def _input(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if x.dim():
        rows = torch.exp(torch.randn(*shape[:-1], 1, generator=gen))  # [..., 1] per-row scale
        x = x * rows
    return x.to(dtype)


def bench_codecs(
    shapes: Sequence[Sequence[int]],
    codecs: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    seed: int = 0,
) -> dict:
    """``{codec: {"AxBxC": {raw_bytes, wire_bytes, ratio, encode_ms, decode_ms, max_abs_err, max_rel_err}}}``.

    ``raw_bytes`` is the input's size in ``dtype``; ``ratio`` = wire_bytes / raw_bytes; ``max_rel_err`` is the max
    absolute error divided by the max |x| of the tensor (0 for lossless codecs).
    """
    out: dict = {}
    for codec in codecs:
        parse_codec(codec)
        rows = out.setdefault(codec, {})
        for shape in shapes:
            x = _input(shape, dtype, seed)
            enc, dec = [], []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                header, payload = encode_tensor(x, codec)
                t1 = time.perf_counter()
                y = decode_tensor(header, payload, max_bytes=1 << 40)
                t2 = time.perf_counter()
                enc.append(t1 - t0)
                dec.append(t2 - t1)
            err = (y.double() - x.double()).abs().max().item() if x.numel() else 0.0
            scale = x.double().abs().max().item() if x.numel() else 0.0
            raw = x.numel() * x.element_size()
            rows["x".join(map(str, shape))] = {
                "raw_bytes": raw,
                "wire_bytes": len(payload),
                "header_bytes": len(msgpack.packb(header)),
                "ratio": len(payload) / raw if raw else 0.0,
                "encode_ms": 1e3 * statistics.median(enc),
                "decode_ms": 1e3 * statistics.median(dec),
                "max_abs_err": err,
                "max_rel_err": err / scale if scale else 0.0,
            }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Benchmark the wire codecs.")
    ap.add_argument("--shapes", nargs="+", default=["576x4096", "8x1024x128"], help="e.g. 576x4096 1x8x512x128")
    ap.add_argument("--codecs", nargs="+", default=["fp32", "fp16", "bf16", "int8", "fp16+lz4", "int8+zstd"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    res = bench_codecs(shapes, args.codecs, dtype=getattr(torch, args.dtype), repeats=args.repeats)
    print(f"{'codec':<12} {'shape':<16} {'wire MB':>9} {'ratio':>6} {'enc ms':>8} {'dec ms':>8} {'max rel err':>12}")
    for codec, by_shape in res.items():
        for shape, r in by_shape.items():
            print(f"{codec:<12} {shape:<16} {r['wire_bytes'] / 1e6:>9.3f} {r['ratio']:>6.3f} {r['encode_ms']:>8.2f} "
                  f"{r['decode_ms']:>8.2f} {r['max_rel_err']:>12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
