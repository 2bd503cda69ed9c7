"""``IngressEngine``: the HTTP ingress's work without Ray: validate a ``POST /generate`` body, apply the chat
template, tokenize, decode images, and turn verifier chunks into the response records.

Request body (JSON; unknown keys are a 400)::

    {"prompt": "What colour is the circle?", "images": ["<base64 PNG>"], "max_tokens": 64,
     "temperature": 0.0, "seed": 0, "stream": false}

Images go where the prompt says ``<image>``, else in front of it. Response (``stream: false``)::

    {"id": "...", "text": "...", "tokens": [...], "finish_reason": "eos" | "length" | "cancelled",
     "usage": {"prompt_tokens": 161, "completion_tokens": 12}, "metrics": {"tau": ..., ...}, "drafter": "ok"}

With ``stream: true`` the body is NDJSON: ``{"id", "tokens", "text"}`` per step (text is the new piece), then one
record with ``"finished": true`` and the fields above but "text" and "tokens". A failure after the first byte is a
last record ``{"error": {...}}`` and no ``finished`` record, so a client can never mistake it for a short answer.
"""

from __future__ import annotations

import base64
import binascii
import io
import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specula.runtime.engine import GenerationRequest
from specula.runtime.sampling import SamplingParams

IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})


class RequestError(ValueError):
    """A request the ingress refuses (HTTP 400); the message names the field or limit."""

    status = 400


class GenerateBody(BaseModel):
    """The ``POST /generate`` body."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="The user's message; '<image>' marks where each image goes.")
    images: list[str] = Field(default_factory=list,
                              description="Images as base64 PNG/JPEG/WebP, optionally as data: URLs.")
    max_tokens: int = Field(64, ge=1, description="New tokens at most.")
    temperature: float = Field(0.0, ge=0, le=100, description="0 = greedy; > 0 samples.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seeds the request's sampler.")
    stream: bool = Field(False, description="NDJSON records as tokens are accepted, instead of one JSON object.")


class IngressEngine:
    """Per-request preparation and response shaping; stateless apart from the processor, so thread-safe."""

    def __init__(self, processor, limits) -> None:
        self.processor, self.limits = processor, limits
        self.tokenizer = processor.tokenizer
        self.image_token = getattr(processor, "image_token", "<image>")

    @classmethod
    def from_config(cls, config) -> IngressEngine:
        from specula.runtime.serve.factory import load_processor_for, set_threads

        set_threads(config.deployments.ingress)
        return cls(load_processor_for(config), config.limits)

    # ------------------------------------------------------------------------------------------- requests

    def parse(self, raw: bytes | str | dict) -> GenerateBody:
        if isinstance(raw, (bytes, str)):
            if len(raw) > self.limits.max_request_bytes:
                raise RequestError(f"request body of {len(raw)} bytes > max_request_bytes="
                                   f"{self.limits.max_request_bytes}")
            try:
                raw = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"body is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise RequestError("body must be a JSON object")
        try:
            body = GenerateBody.model_validate(raw)
        except ValidationError as e:
            raise RequestError("; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: "
                f"{'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}" for err in e.errors())) from None
        if body.max_tokens > self.limits.max_tokens:
            raise RequestError(f"max_tokens {body.max_tokens} > the limit {self.limits.max_tokens}")
        if len(body.images) > self.limits.max_images:
            raise RequestError(f"{len(body.images)} images > max_images={self.limits.max_images}")
        return body

    def prepare(self, body: GenerateBody, request_id: str) -> GenerationRequest:
        """Chat template + tokens + pixels; the request the verifier runs (visual features come later)."""
        images = [self._image(s, i) for i, s in enumerate(body.images)]
        parts = body.prompt.split(self.image_token)
        if len(parts) > 1 and len(parts) - 1 != len(images):
            raise RequestError(f"the prompt has {len(parts) - 1} '{self.image_token}' markers for {len(images)} images")
        content: list[dict] = []
        if len(parts) == 1:
            content += [{"type": "image"}] * len(images) + [{"type": "text", "text": body.prompt}]
        else:
            for i, text in enumerate(parts):
                if i:
                    content.append({"type": "image"})
                if text:
                    content.append({"type": "text", "text": text})
        text = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
        if images:
            enc = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        else:
            enc = self.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"][0]  # [L] int64
        if ids.numel() > self.limits.max_prompt_tokens:
            raise RequestError(f"prompt of {ids.numel()} tokens > max_prompt_tokens={self.limits.max_prompt_tokens}")
        params = SamplingParams(temperature=body.temperature, seed=body.seed, max_tokens=body.max_tokens)
        return GenerationRequest(request_id, ids, enc.get("pixel_values"), params, enc.get("image_grid_thw"))

    def _image(self, data: str, i: int):
        from PIL import Image, UnidentifiedImageError

        if data.startswith("data:"):
            head, _, data = data.partition(",")
            if not head.endswith(";base64"):
                raise RequestError(f"images[{i}]: a data: URL must be base64")
        if len(data) > (self.limits.max_image_bytes + 2) // 3 * 4 + 4:
            raise RequestError(f"images[{i}]: more than max_image_bytes={self.limits.max_image_bytes}")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"images[{i}]: not valid base64") from None
        if len(raw) > self.limits.max_image_bytes:
            raise RequestError(f"images[{i}]: {len(raw)} bytes > max_image_bytes={self.limits.max_image_bytes}")
        try:
            with Image.open(io.BytesIO(raw)) as im:
                if im.format not in IMAGE_FORMATS:
                    raise RequestError(f"images[{i}]: format {im.format} is not one of {sorted(IMAGE_FORMATS)}")
                w, h = im.size
                if w * h > self.limits.max_image_pixels:
                    raise RequestError(f"images[{i}]: {w}x{h} pixels > max_image_pixels="
                                       f"{self.limits.max_image_pixels}")
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise RequestError(f"images[{i}]: cannot be decoded: {e}") from None

    # ------------------------------------------------------------------------------------------- responses

    def response(self, request: GenerationRequest) -> Response:
        return Response(self.tokenizer, request.request_id, int(request.input_ids.numel()))


class Response:
    """One request's answer, built from verifier chunks: stream records as they come, or the whole result."""

    def __init__(self, tokenizer, request_id: str, prompt_tokens: int) -> None:
        self.tokenizer, self.request_id, self.prompt_tokens = tokenizer, request_id, prompt_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.final: dict | None = None

    def add(self, chunk: dict) -> list[dict]:
        """The NDJSON records ``chunk`` produces (a token record, then the finished record if it is the last)."""
        out = []
        if chunk["tokens"]:
            self.tokens.extend(chunk["tokens"])
            out.append({"id": self.request_id, "tokens": list(chunk["tokens"]), "text": self._delta()})
        if chunk["finished"]:
            self.final = {"id": self.request_id, "finished": True, "finish_reason": chunk["finish_reason"],
                          "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens)},
                          "metrics": chunk.get("metrics"), "drafter": chunk.get("drafter")}
            tail = self._delta(final=True)
            if tail:
                out.append({"id": self.request_id, "tokens": [], "text": tail})
            out.append(self.final)
        return out

    def result(self) -> dict:
        if self.final is None:
            raise RuntimeError("the verifier stream ended without a finished chunk")
        rest = {k: v for k, v in self.final.items() if k not in ("id", "finished")}
        return {"id": self.request_id, "text": self.text, "tokens": list(self.tokens), **rest}

    def _delta(self, final: bool = False) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""  # a character cut between tokens: wait for the rest
        # decoding is not always prefix-stable (merged spaces); "text" of the result is the authoritative whole
        delta = text[len(self.text):]
        self.text = text
        return delta


def error_record(exc: BaseException) -> dict:
    return {"error": {"type": type(exc).__name__, "message": str(exc)[:2000]}}
