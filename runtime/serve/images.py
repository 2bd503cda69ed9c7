"""Where request images come from, and decoding them within the limits (``LimitsConfig``), before any pixel is
allocated::

    loader = ImageLoader(config.limits)
    loader.from_base64("iVBORw0...", "images[0]")                       # POST /generate: base64 or a data: URL
    loader.from_url("data:image/png;base64,iVBOR...", where)            # OpenAI image_url
    loader.from_url("file:///srv/images/cat.png", where)               # a file under limits.image_dir
    loader.from_url("https://...", where)                               # only with limits.allow_remote_images
    loader.from_bytes(raw_png, "image")                                 # gRPC: raw PNG/JPEG/WebP bytes

Every failure is a ``RequestError`` naming ``where`` (the request field). Decompression bombs: the header's
width x height is checked against ``max_image_pixels`` before the image is decoded, and PIL's own guard
(``Image.MAX_IMAGE_PIXELS``, process-wide) is set to the same limit: PIL refuses an image over twice it while
opening, and warns (once per process) for one between the limit and twice it, which our check then refuses.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from pathlib import Path

from specula.runtime.serve.errors import RequestError

IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})


class ImageLoader:
    def __init__(self, limits) -> None:
        from PIL import Image

        self.limits = limits
        # PIL warns above MAX_IMAGE_PIXELS and raises above twice it; our explicit check comes first anyway
        Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
        self.image_dir = Path(limits.image_dir).resolve() if limits.image_dir else None

    def from_bytes(self, raw: bytes, where: str):
        """Encoded PNG/JPEG/WebP bytes -> an RGB PIL image."""
        from PIL import Image, UnidentifiedImageError

        if len(raw) > self.limits.max_image_bytes:
            raise RequestError(f"{where}: {len(raw)} bytes > max_image_bytes={self.limits.max_image_bytes}", where)
        try:
            with Image.open(io.BytesIO(raw)) as im:  # reads the header only
                if im.format not in IMAGE_FORMATS:
                    raise RequestError(f"{where}: format {im.format} is not one of {sorted(IMAGE_FORMATS)}", where)
                w, h = im.size
                if w * h > self.limits.max_image_pixels:
                    raise RequestError(f"{where}: {w}x{h} pixels > max_image_pixels="
                                       f"{self.limits.max_image_pixels}", where)
                return im.convert("RGB")
        except Image.DecompressionBombError:  # PIL's guard: over twice the limit, refused while opening
            raise RequestError(f"{where}: more than max_image_pixels={self.limits.max_image_pixels} pixels",
                               where) from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            if isinstance(e, RequestError):
                raise
            raise RequestError(f"{where}: cannot be decoded: {e}", where) from None

    def from_base64(self, data: str, where: str):
        """Base64 (optionally a ``data:image/...;base64,`` URL) -> an RGB PIL image."""
        if data.startswith("data:"):
            head, _, data = data.partition(",")
            if not head.endswith(";base64"):
                raise RequestError(f"{where}: a data: URL must be base64", where)
        if len(data) > (self.limits.max_image_bytes + 2) // 3 * 4 + 4:
            raise RequestError(f"{where}: more than max_image_bytes={self.limits.max_image_bytes}", where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: not valid base64", where) from None
        return self.from_bytes(raw, where)

    def from_url(self, url: str, where: str):
        """An OpenAI ``image_url.url``: a data: URL, a local file under ``image_dir``, or (if allowed) http(s)."""
        scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
        if scheme == "data":
            return self.from_base64(url, where)
        if scheme in ("http", "https"):
            return self.from_bytes(self._fetch(url, where), where)
        if scheme in ("", "file"):
            return self.from_bytes(self._read_file(url, where), where)
        raise RequestError(f"{where}: unsupported URL scheme {scheme!r} (use a data: URL, a file under the "
                           "server's image_dir, or http(s) where the server allows it)", where)

    def _read_file(self, url: str, where: str) -> bytes:
        if self.image_dir is None:
            raise RequestError(f"{where}: local image files are off on this server (limits.image_dir is not set); "
                               "send a data: URL", where)
        path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url
        candidate = Path(path) if os.path.isabs(path) else self.image_dir / path
        try:
            real = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            raise RequestError(f"{where}: no such file under the image directory", where) from None
        if not real.is_relative_to(self.image_dir) or not real.is_file():
            raise RequestError(f"{where}: not a file under the server's image directory", where)
        size = real.stat().st_size
        if size > self.limits.max_image_bytes:
            raise RequestError(f"{where}: {size} bytes > max_image_bytes={self.limits.max_image_bytes}", where)
        with open(real, "rb") as f:
            return f.read(self.limits.max_image_bytes + 1)

    def _fetch(self, url: str, where: str) -> bytes:
        if not self.limits.allow_remote_images:
            raise RequestError(f"{where}: remote image URLs are off on this server (limits.allow_remote_images); "
                               "send a data: URL", where)
        import urllib.request

        cap = self.limits.max_image_bytes
        req = urllib.request.Request(url, headers={"User-Agent": "specula", "Accept": "image/*"})
        try:
            with urllib.request.urlopen(req, timeout=self.limits.image_fetch_timeout_s) as r:  # noqa: S310
                declared = r.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > cap:
                    raise RequestError(f"{where}: {declared} bytes > max_image_bytes={cap}", where)
                raw = r.read(cap + 1)  # never more than the limit + 1 in memory
        except RequestError:
            raise
        except Exception as e:  # DNS, refused, timeout, HTTP error status: the client's URL did not work
            raise RequestError(f"{where}: fetching the image failed: {e}", where) from None
        if len(raw) > cap:
            raise RequestError(f"{where}: more than max_image_bytes={cap}", where)
        return raw
