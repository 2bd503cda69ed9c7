"""Tensor codecs: round trips for every codec x input dtype x shape, lossless exactness, lossy error bounds."""

from __future__ import annotations

import msgpack
import pytest
import torch

from specula.runtime.wire import CODECS, WireError, decode_tensor, encode_tensor, negotiate_codec, parse_codec

SHAPES = [
    (),  # scalar
    (0,),  # empty
    (7,),  # 1-D
    (3, 0),  # empty last dim
    (0, 5),  # empty rows
    (2, 3),
    (2, 4, 16, 8),  # KV-shaped [B, H_kv, T, D]
    (1, 2, 1, 3, 1, 2, 1, 2),  # rank 8 = MAX_RANK
]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
TINY = {torch.float32: 1e-38, torch.float16: 2.0**-25, torch.bfloat16: 1e-38, torch.float64: 0.0}  # half subnormal
MAX = 1 << 24


def sample(shape, dtype, seed=0) -> torch.Tensor:
    """N(0, 1) with a log-normal scale per row (rows of very different norms, like hidden states), one zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if x.dim() and x.numel():
        x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen))
        x.reshape(-1, shape[-1])[0] = 0.0
    return x.to(dtype)


def roundtrip(x, codec, **kw):
    header, payload = encode_tensor(x, codec, **kw)
    assert msgpack.unpackb(msgpack.packb(header)) == header  # headers are plain msgpack-able dicts
    assert header["payload_nbytes"] == len(payload)
    return header, decode_tensor(header, payload, max_bytes=MAX)


def check_bound(x: torch.Tensor, y: torch.Tensor, codec: str) -> None:
    c = parse_codec(codec)
    xd, yd = x.double(), y.double()
    err = (yd - xd).abs()
    out_eps, out_tiny = UNIT_ROUNDOFF[y.dtype], TINY[y.dtype]
    if c.is_lossless(x.dtype):
        assert torch.equal(x, y), codec
    elif c.base in ("fp16", "bf16"):
        wire = c.wire_dtype(x.dtype)
        tol = (UNIT_ROUNDOFF[wire] + out_eps) * xd.abs() * 1.0001 + TINY[wire] + out_tiny
        assert bool((err <= tol).all()), f"{codec}: max err {err.max().item()}"
    elif c.base == "int8" and x.numel():
        d = x.shape[-1] if x.dim() else 1
        rows = xd.reshape(-1, d)  # [R, D]
        scale = rows.abs().amax(1, keepdim=True) / 127  # [R, 1]
        tol = scale / 2 * (1 + 2.0**-9) + out_eps * rows.abs() * 1.01 + out_tiny  # fp16-stored scales round up
        assert bool((err.reshape(-1, d) <= tol).all()), f"{codec}: max err {err.max().item()}"


@pytest.mark.parametrize("codec", CODECS)
def test_roundtrip_every_shape_and_dtype(codec):
    for dtype in FLOATS:
        for shape in SHAPES:
            x = sample(shape, dtype)
            header, y = roundtrip(x, codec)
            assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "cpu", (codec, dtype, shape)
            assert header["shape"] == list(shape) and header["dtype"] == str(dtype).removeprefix("torch.")
            check_bound(x, y, codec)


@pytest.mark.parametrize("codec", ["raw", "fp32", "raw+lz4", "fp32+zstd"])
def test_fp32_codecs_are_bit_exact_including_specials(codec):
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38, -1.5])
    _, y = roundtrip(x, codec)
    assert torch.equal(x.view(torch.int32), y.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_integer_tensors_travel_raw_and_refuse_float_codecs(dtype):
    x = torch.randint(0, 2 if dtype == torch.bool else 100, (3, 5)).to(dtype)
    for codec in ("raw", "raw+lz4", "raw+zstd"):
        _, y = roundtrip(x, codec)
        assert torch.equal(x, y) and y.dtype == dtype
    for codec in ("fp32", "fp16", "int8+zstd"):
        with pytest.raises(WireError, match="floating-point"):
            encode_tensor(x, codec)


def test_fp16_relative_error_on_hidden_like_values():
    x = torch.randn(64, 512) * 3
    _, y = roundtrip(x, "fp16")
    rel = ((y - x).abs() / x.abs().clamp_min(2.0**-14)).max().item()
    assert 0 < rel <= 2.0**-11 * 1.0001


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int8_error_within_half_a_stored_scale_per_row(scale_dtype):
    x = sample((4, 2, 32, 16), torch.float32, seed=3)  # [B, H_kv, T, D]
    header, payload = encode_tensor(x, "int8", scale_dtype=scale_dtype)
    assert header["scale_dtype"] == str(scale_dtype).removeprefix("torch.")
    assert header["scale_count"] == 4 * 2 * 32
    rows = header["scale_count"]
    stored = torch.frombuffer(bytearray(payload[: rows * scale_dtype.itemsize]), dtype=scale_dtype).double()  # [R]
    y = decode_tensor(header, payload, max_bytes=MAX)
    err = (y.double() - x.double()).reshape(rows, 16).abs().amax(1)  # [R]
    assert bool((err <= stored / 2 * (1 + 1e-6) + 1e-12).all())
    exact = x.double().reshape(rows, 16).abs().amax(1) / 127
    assert bool((stored >= exact * (1 - 1e-7)).all())  # never rounded down: no clamping error


def test_int8_fp16_scales_fall_back_to_fp32_out_of_range():
    x = torch.tensor([[1e7, -2.0], [1e-9, 0.0], [1.0, 0.5]])
    header, payload = encode_tensor(x, "int8", scale_dtype=torch.float16)
    assert header["scale_dtype"] == "float32"
    y = decode_tensor(header, payload, max_bytes=MAX)
    assert bool(((y - x).abs() <= x.abs().amax(1, keepdim=True) / 254 * 1.000001).all())


def test_int8_refuses_non_finite_values():
    with pytest.raises(WireError, match="finite"):
        encode_tensor(torch.tensor([[1.0, float("nan")]]), "int8")
    with pytest.raises(WireError, match="finite"):
        encode_tensor(torch.tensor([float("inf")]), "int8+lz4")


def test_decode_into_another_dtype_and_device():
    x = sample((3, 8), torch.bfloat16)
    header, payload = encode_tensor(x, "bf16+zstd")
    y = decode_tensor(header, payload, max_bytes=MAX, dtype=torch.float32, device=torch.device("cpu"))
    assert y.dtype == torch.float32 and torch.equal(y, x.float())


def test_non_contiguous_and_grad_inputs():
    base = torch.randn(6, 4, requires_grad=True)
    x = base.t()[:, ::2]  # [4, 3], non-contiguous, part of a graph
    _, y = roundtrip(x, "fp32+lz4")
    assert torch.equal(y, x.detach()) and not y.requires_grad


def test_compression_shrinks_redundant_data():
    x = torch.zeros(256, 1024)
    for codec in ("fp32+lz4", "fp32+zstd", "int8+zstd"):
        header, payload = encode_tensor(x, codec)
        assert len(payload) < header["raw_nbytes"] // 50, codec
        assert torch.equal(decode_tensor(header, payload, max_bytes=MAX), x)


def test_rank_above_max_is_refused_at_encode():
    with pytest.raises(WireError, match="MAX_RANK"):
        encode_tensor(torch.zeros([1] * 9), "fp32")


def test_negotiation_takes_the_servers_first_shared_choice():
    assert negotiate_codec(["fp16", "fp32"], ["int8+zstd", "fp16", "fp32"]) == "fp16"
    assert negotiate_codec(["fp32", "int8+zstd"], ["int8+zstd", "fp32"]) == "int8+zstd"
    with pytest.raises(WireError, match="no codec in common"):
        negotiate_codec(["fp32"], ["fp16", "bf16"])
    with pytest.raises(WireError, match="unknown codec"):
        negotiate_codec(["fp8"], ["fp32"])
    with pytest.raises(WireError, match="unknown codec"):
        negotiate_codec(["fp32"], ["fp32+gzip"])


def test_codec_names_are_exact():
    assert parse_codec("int8+zstd").name == "int8+zstd"
    for bad in ("INT8", "int8+", "+zstd", "int8+zstd+lz4", "fp16 ", "", None, 3):
        with pytest.raises(WireError):
            parse_codec(bad)
