"""lz4 / zstd around a tensor's encoded bytes, with decompression bounded by the size the header declares.

Both decoders first read the frame's own content-size field and require it to equal the declared size, so a small
frame that claims (or expands to) gigabytes is rejected before any output buffer exists:

- zstd's one-shot ``decompress`` allocates whatever the frame header claims and ignores ``max_output_size`` when a
  content size is present, hence the explicit check; the window is capped too (it bounds streaming buffers).
- lz4's ``LZ4FrameDecompressor.decompress(max_length=n)`` never returns more than n bytes; a stream that would
  produce more is left unfinished (``eof`` False) and rejected.

Both formats carry a content checksum, so a corrupted stream is an error rather than wrong numbers.
"""

from __future__ import annotations

import lz4.frame
import zstandard

from .errors import WireError

ZSTD_LEVEL = 1  # tensors barely compress better at higher levels, and encode time is on the critical path
LZ4_LEVEL = 0  # lz4's fast mode
ZSTD_MAX_WINDOW = 1 << 27  # zstd's own default limit for decoders
_ZSTD_UNKNOWN = (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_EMPTY = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(b"")  # 13 bytes


def compress(data: bytes | memoryview, compression: str, level: int | None = None) -> bytes:
    if compression == "zstd":
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL if level is None else level, write_checksum=True,
                                        write_content_size=True)
        return cctx.compress(data)
    if compression == "lz4":
        return lz4.frame.compress(data, compression_level=LZ4_LEVEL if level is None else level,
                                  content_checksum=True, store_size=True)
    raise WireError(f"unknown compression {compression!r}")


def decompress(payload: bytes | memoryview, compression: str, raw_nbytes: int) -> bytes:
    """Exactly ``raw_nbytes`` bytes out of one complete ``compression`` frame, or WireError; never allocates more."""
    if compression == "zstd":
        return _zstd(payload, raw_nbytes)
    if compression == "lz4":
        return _lz4(payload, raw_nbytes)
    raise WireError(f"unknown compression {compression!r}")


def _zstd(payload: bytes | memoryview, raw_nbytes: int) -> bytes:
    if bytes(payload[:4]) != _ZSTD_MAGIC:  # also refuses skippable frames, which state a "content size" too
        raise WireError("bad zstd stream: does not start with a zstd frame")
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise WireError(f"bad zstd stream: {e}") from None
    if params.content_size in _ZSTD_UNKNOWN:
        raise WireError("bad zstd stream: frame does not state its content size")
    if params.content_size != raw_nbytes:
        raise WireError(f"zstd frame holds {params.content_size} bytes, header declares raw_nbytes={raw_nbytes}")
    if params.window_size > ZSTD_MAX_WINDOW:
        raise WireError(f"zstd window {params.window_size} exceeds the {ZSTD_MAX_WINDOW}-byte limit")
    if raw_nbytes == 0:  # python-zstandard returns b"" for any frame stating size 0, without reading on
        if bytes(payload) != _ZSTD_EMPTY:
            raise WireError("bad zstd stream: an empty tensor's frame must be the canonical empty frame")
        return b""
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        out = dctx.decompress(payload, max_output_size=raw_nbytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise WireError(f"bad zstd stream: {e}") from None
    if len(out) != raw_nbytes:
        raise WireError(f"zstd stream decompressed to {len(out)} bytes, header declares raw_nbytes={raw_nbytes}")
    return out


def _lz4(payload: bytes | memoryview, raw_nbytes: int) -> bytes:
    try:
        info = lz4.frame.get_frame_info(payload)
    except (RuntimeError, ValueError) as e:
        raise WireError(f"bad lz4 stream: {e}") from None
    if info["content_size"] != raw_nbytes:  # 0 also means "not stated": only valid for an empty tensor
        raise WireError(f"lz4 frame holds {info['content_size']} bytes, header declares raw_nbytes={raw_nbytes}")
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        out = d.decompress(payload, max_length=raw_nbytes)
    except (RuntimeError, ValueError) as e:
        raise WireError(f"bad lz4 stream: {e}") from None
    if len(out) != raw_nbytes or not d.eof:
        raise WireError(f"lz4 stream does not decompress to exactly raw_nbytes={raw_nbytes} bytes")
    if d.unused_data:
        raise WireError(f"bad lz4 stream: {len(d.unused_data)} trailing bytes after the frame")
    return out
