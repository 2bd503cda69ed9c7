"""``IngressEngine``: the ingress's work without Ray: validate a request, apply the chat template, tokenize,
decode images (images.py), and turn verifier chunks into text (``Detokenizer``: stop strings) and response records.
The OpenAI routes translate their bodies in openai_api.py and prepare through the same ``prepare_chat`` /
``prepare_text``; below is the native ``POST /generate``.

Request body (JSON; unknown keys are a 400)::

    {"prompt": "What colour is the circle?", "images": ["<base64 PNG>"], "max_tokens": 64,
     "temperature": 0.0, "seed": 0, "stream": false, "drafter": "ngram"}

Images go where the prompt says ``<image>``, else in front of it. Response (``stream: false``)::

    {"id": "...", "text": "...", "tokens": [...], "finish_reason": "eos" | "length" | "cancelled",
     "usage": {"prompt_tokens": 161, "completion_tokens": 12}, "metrics": {"tau": ..., ...}, "drafter": "ok"}

With ``stream: true`` the body is NDJSON: ``{"id", "tokens", "text"}`` per step (text is the new piece), then one
record with ``"finished": true`` and the fields above but "text" and "tokens". A failure after the first byte is a
last record ``{"error": {...}}`` and no ``finished`` record, so a client can never mistake it for a short answer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.errors import RequestError, error_record
from specula.runtime.serve.image_order import image_parts_first
from specula.runtime.serve.images import IMAGE_FORMATS, ImageLoader

__all__ = ["Detokenizer", "GenerateBody", "IMAGE_FORMATS", "IngressEngine", "RequestError", "Response",
           "error_record", "served_model_name"]


class GenerateBody(BaseModel):
    """The ``POST /generate`` body; unknown fields and values of the wrong JSON type (``"stream": "yes"``) are
    refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, description="The user's message; '<image>' marks where each image goes.")
    images: list[str] = Field(default_factory=list,
                              description="Images as base64 PNG/JPEG/WebP, optionally as data: URLs.")
    max_tokens: StrictInt = Field(64, ge=1, description="New tokens at most.")
    temperature: StrictFloat = Field(0.0, ge=0, le=100, description="0 = greedy; > 0 samples.")
    seed: StrictInt | None = Field(None, ge=0, lt=2**63, description="Seeds the request's sampler.")
    stream: StrictBool = Field(False, description="NDJSON records as tokens are accepted, instead of one JSON object.")
    drafter: str | None = Field(None, description="The drafter to speculate with, by name (config drafter.kind / "
                                                  "drafter.name or a drafter.alternatives key); null = the default.")


class IngressEngine:
    """Per-request preparation and response shaping; stateless apart from the processor, so thread-safe.

    Every front door (POST /generate, the OpenAI routes in openai_api.py, the gRPC API) builds its
    ``GenerationRequest`` through ``prepare_chat`` / ``prepare_text``, so limits, the chat template and image
    handling are the same whichever door a request comes through. ``model_name`` is the id the OpenAI routes and
    gRPC ListModels report; ``drafter_kind`` the name of the default drafter (None: no drafting, gamma 0) and
    ``drafters`` every name a request may choose, the default first (``check_drafter``; default: just
    ``drafter_kind``).
    """

    def __init__(self, processor, limits, model_name: str = "target", drafter_kind: str | None = None,
                 drafters: tuple[str, ...] | None = None, image_parts_first: bool = False) -> None:
        self.processor, self.limits = processor, limits
        self.image_parts_first = image_parts_first  # each user message's run of images goes first (image_order.py)
        self.model_name, self.drafter_kind = model_name, drafter_kind
        self.drafters = tuple(drafters) if drafters is not None else ((drafter_kind,) if drafter_kind else ())
        self.tokenizer = processor.tokenizer
        self.image_token = getattr(processor, "image_token", "<image>")
        self.images = ImageLoader(limits)

    @classmethod
    def from_config(cls, config) -> IngressEngine:
        from specula.runtime.engine.factory import load_processor_for, reads_images_first, set_threads

        set_threads(config.deployments.ingress)
        on = config.drafter.gamma > 0
        return cls(load_processor_for(config), config.limits, model_name=served_model_name(config),
                   drafter_kind=config.drafter.default_name if on else None,
                   drafters=config.drafter.names() if on else (), image_parts_first=reads_images_first(config))

    # ------------------------------------------------------------------------------------------- requests

    def parse(self, raw: bytes | str | dict) -> GenerateBody:
        """A ``POST /generate`` body: JSON -> a validated ``GenerateBody`` (RequestError naming the field)."""
        raw = self.load_json(raw)
        try:
            body = GenerateBody.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            raise RequestError("; ".join(
                f"{_loc(x['loc']) or 'body'}: "
                f"{'unknown key' if x['type'] == 'extra_forbidden' else x['msg']}" for x in e.errors()),
                _loc(err["loc"]) or None) from None
        self.check_max_tokens(body.max_tokens)
        self.check_drafter(body.drafter)
        if len(body.images) > self.limits.max_images:
            raise RequestError(f"{len(body.images)} images > max_images={self.limits.max_images}", "images")
        return body

    def load_json(self, raw: bytes | str | dict) -> dict:
        """Bytes/str -> a JSON object, within max_request_bytes (413 beyond it)."""
        if isinstance(raw, (bytes, str)):
            if len(raw) > self.limits.max_request_bytes:
                raise RequestError(f"request body of {len(raw)} bytes > max_request_bytes="
                                   f"{self.limits.max_request_bytes}", status=413)
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"body is not JSON: {e}") from None
            except RecursionError:
                raise RequestError("body nests arrays or objects too deeply") from None
            where = _lone_surrogate(data)  # JSON may spell one ("\\ud800"); UTF-8 and the tokenizer cannot
            if where is not None:
                raise RequestError(f"{where}: holds a lone UTF-16 surrogate, which is not text",
                                   where if where != "body" else None)
            raw = data
        if not isinstance(raw, dict):
            raise RequestError("body must be a JSON object")
        return raw

    def prepare(self, body: GenerateBody, request_id: str) -> GenerationRequest:
        """Chat template + tokens + pixels; the request the verifier runs (visual features come later)."""
        from specula.runtime.engine.prompts import IMAGE_MARK, prompt_messages

        images = [self.images.from_base64(s, f"images[{i}]") for i, s in enumerate(body.images)]
        # '<image>' marks the images whatever the checkpoint spells them (Qwen2.5-VL: <|vision_start|>...)
        marks = body.prompt.count(IMAGE_MARK)
        if marks and marks != len(images):
            raise RequestError(f"the prompt has {marks} '{IMAGE_MARK}' markers for {len(images)} images", "prompt")
        (message,) = prompt_messages(body.prompt, len(images))
        params = SamplingParams(temperature=body.temperature, seed=body.seed, max_tokens=body.max_tokens)
        return self.prepare_chat([message], images, params, request_id, "prompt",
                                 drafter=self.check_drafter(body.drafter))

    def prepare_chat(self, messages: list[dict], images: list, params: SamplingParams, request_id: str,
                     where: str = "messages", drafter: str | None = None) -> GenerationRequest:
        """Messages in the processor's chat format (``{"role", "content": str | [{"type": "text", "text"} |
        {"type": "image"}]}``, one ``image`` part per entry of ``images``, in order) -> the request.
        ``drafter``: the request's drafter choice, as ``check_drafter`` returned it."""
        if len(images) > self.limits.max_images:
            raise RequestError(f"{len(images)} images > max_images={self.limits.max_images}", where)
        self.check_max_tokens(params.max_tokens)
        if self.image_parts_first:
            messages = image_parts_first(messages)
        from specula.runtime.engine.prompts import encode_messages

        prompt = encode_messages(self.processor, messages, images)  # the one prompt path (engine/prompts.py)
        self.check_prompt_tokens(prompt.input_ids.numel(), where)
        return prompt.request(request_id, params, drafter=drafter)

    def prepare_text(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     where: str = "prompt", drafter: str | None = None) -> GenerationRequest:
        """A raw text prompt (no chat template; the tokenizer's BOS in front, as the model saw in training) or
        exact token ids -> the request. Text only: the image token is refused. ``drafter`` as for prepare_chat."""
        import torch

        self.check_max_tokens(params.max_tokens)
        image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if isinstance(prompt, str):
            if self.image_token in prompt:
                raise RequestError(f"{where}: contains the image token {self.image_token!r}; this route takes text "
                                   "only (send images to /v1/chat/completions)", where)
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            bos = self.tokenizer.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        else:
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab or t == image_id]
            if bad:
                raise RequestError(f"{where}: token ids {bad[:5]} are outside [0, {vocab}) or the image token", where)
            ids = list(prompt)
        if not ids:
            raise RequestError(f"{where}: empty prompt", where)
        self.check_prompt_tokens(len(ids), where)
        return GenerationRequest(request_id, torch.tensor(ids, dtype=torch.long), None, params, drafter=drafter)

    def check_max_tokens(self, n: int, where: str = "max_tokens") -> None:
        if n > self.limits.max_tokens:
            raise RequestError(f"{where} {n} > the limit {self.limits.max_tokens}", where)

    def check_prompt_tokens(self, n: int, where: str = "messages") -> None:
        if n > self.limits.max_prompt_tokens:
            raise RequestError(f"prompt of {n} tokens > max_prompt_tokens={self.limits.max_prompt_tokens}",
                               where, code="context_length_exceeded")

    def check_drafter(self, name: str | None, where: str = "drafter") -> str | None:
        """A request's drafter choice -> what the request carries (``GenerationRequest.drafter``; None = the
        default). One of ``drafters`` (config ``drafter.names()``), or none; with gamma 0 only "none". Anything
        else is refused (400 / INVALID_ARGUMENT naming ``where`` and listing the choices), never ignored."""
        if name is None or name in self.drafters:
            return name
        if not self.drafters:
            if name == "none":
                return None
            raise RequestError(f"{where}: {name!r} is not served here; this deployment does not speculate "
                               "(gamma 0): give 'none' or leave it out", where)
        raise RequestError(f"{where}: {name!r} is not served here; choose one of {list(self.drafters)} (default "
                           f"{self.drafters[0]!r}) or leave it out", where)

    # ------------------------------------------------------------------------------------------- responses

    def response(self, request: GenerationRequest) -> Response:
        return Response(self.tokenizer, request.request_id, int(request.input_ids.numel()))

    def detokenizer(self, request: GenerationRequest) -> Detokenizer:
        return Detokenizer(self.tokenizer, request.params.stop)

    @staticmethod
    def upstream(request: GenerationRequest) -> GenerationRequest:
        """What the verifier runs: stop strings are matched here on the text (see Detokenizer), not there."""
        if not request.params.stop:
            return request
        return replace(request, params=replace(request.params, stop=()))


def served_model_name(config) -> str:
    """The model id clients see: ``http.served_model_name``, else the last part of ``model.path``."""
    return config.http.served_model_name or Path(config.model.path.rstrip("/\\")).name or config.model.path


class Detokenizer:
    """Verifier chunks -> the same chunks with ``"text"``: the new visible text, stop strings applied.

    Text a stop string might still begin is held back until it cannot (so streamed text never shows part of a stop
    string); a stop string ends the answer just before it, and the chunk that completes it comes back finished
    with finish_reason "stop" (the caller then cancels the verifier's stream; that chunk has no "metrics").
    ``text`` is the concatenation of every delta, so a streamed and a whole answer are the same string::

        detok = Detokenizer(tokenizer, stop=("\\n\\n",))
        for chunk in verifier_chunks:
            out = detok.add(chunk)          # {..., "tokens", "text", "finished", "finish_reason"}
            if out["finished"]: break
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.tokens: list[int] = []
        self.text = ""  # visible text sent so far
        self._is_byte: dict[int, bool] = {}

    def add(self, chunk: dict) -> dict:
        self.tokens.extend(chunk["tokens"])
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        finished, reason = chunk["finished"], chunk["finish_reason"]
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            full, finished, reason = full[:cut], True, "stop"
        end = len(full)
        if not finished:
            tail = self._byte_tail()
            if tail:  # a run of byte-fallback tokens decodes as a whole: a later byte can rewrite all of it
                stable = self.tokenizer.decode(self.tokens[:-tail], skip_special_tokens=True)
                end = min(len(stable), len(full)) if full.startswith(stable) else len(self.text)
            if full[:end].endswith("\ufffd"):  # a character cut between tokens: wait for the rest
                end = len(self.text)
            else:
                end -= self._held(full[:end])
        # decoding is not always prefix-stable (merged spaces): the new text is what lies past what was sent
        delta = full[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        out = {**chunk, "text": delta, "finished": finished, "finish_reason": reason}
        if finished and not chunk["finished"]:
            out.update(metrics=None, drafter=None)
        return out

    def _byte_tail(self) -> int:
        """How many of the last tokens are byte-fallback pieces (``<0xNN>``, SentencePiece / Llama tokenizers)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)  # None: a tokenizer with no pieces
        n = 0
        for t in reversed(self.tokens) if convert is not None else ():
            if t not in self._is_byte:
                piece = convert(int(t))
                self._is_byte[t] = isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") \
                    and piece.endswith(">")
            if not self._is_byte[t]:
                break
            n += 1
        return n

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


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


def _lone_surrogate(data) -> str | None:
    """Where in parsed JSON a string (or key) holds an unpaired surrogate, or None; iterative: any depth."""
    todo = [(data, "")]
    while todo:
        value, where = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                todo += [(k, where or "body"), (v, f"{where}.{k}" if where else str(k))]
        elif isinstance(value, list):
            todo += [(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return None


def _loc(loc) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
