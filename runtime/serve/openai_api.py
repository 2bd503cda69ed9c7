"""The OpenAI-compatible API without Ray or HTTP: request bodies -> ``GenerationRequest``, verifier chunks -> the
objects OpenAI's clients expect (``chat.completion``, ``chat.completion.chunk``, ``text_completion``)::

    api = OpenAIApi(ingress_engine)
    plan = api.parse("chat", raw_json)                 # cheap: JSON, schema, refusals, model, sampling parameters
    request = api.prepare(plan, request_id)            # images + chat template + tokens (run it off the event loop)
    shaper = api.shaper(plan, request)
    for chunk in detokenized_verifier_chunks:          # IngressEngine.detokenizer(request).add(...)
        for obj in shaper.add(chunk): send(sse(obj))   # stream: true  (then SSE_DONE)
    shaper.result()                                    # stream: false

What is accepted (``POST /v1/chat/completions``; ``/v1/completions`` takes ``prompt`` instead of ``messages``):

- ``messages``: roles system / developer (= system) / user / assistant; ``content`` a string or parts
  ``{"type": "text", "text"}`` and ``{"type": "image_url", "image_url": {"url", "detail"}}`` where url is a
  ``data:image/...;base64,`` URL, a file under ``limits.image_dir`` (path or ``file://``), or http(s) when
  ``limits.allow_remote_images`` (images.py). ``detail`` and a message's ``name`` are accepted and have no effect.
- sampling: ``temperature`` (default 1.0, as OpenAI's), ``top_p``, ``seed``, ``max_tokens`` /
  ``max_completion_tokens`` (chat default: ``limits.max_tokens``; completions default 16, as OpenAI's),
  ``stop`` (string or list), ``n`` (1 only); extensions (vLLM's names; ``extra_body`` in the openai client):
  ``top_k`` (0 or -1 = off), ``min_p``, ``drafter`` (the drafter to speculate with, by name: one of the
  deployment's, listed by ``GET /v1/models`` as ``drafters``; see ``IngressEngine.check_drafter``).
- ``stream`` with ``stream_options.include_usage``.
- accepted and ignored because they cannot change the output here: ``user``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``, ``safety_identifier``, ``prompt_cache_key``.
- refused with 400 naming the field unless left at their no-op value: ``n`` > 1, ``logprobs``, ``top_logprobs``,
  ``tools`` / ``tool_choice`` / ``functions`` / ``function_call``, ``response_format`` other than text,
  ``presence_penalty`` / ``frequency_penalty`` != 0, ``logit_bias``, ``modalities`` other than text, ``audio``,
  ``prediction``, ``reasoning_effort``, ``verbosity``, ``web_search_options``, ``echo``, ``suffix``, ``best_of`` > 1.
  Anything else unknown is a 400 too (a typo never passes silently).

Statuses, as OpenAI's own API answers them: 400 for any request it cannot run (not JSON, an unknown or unsupported
field, a field of the wrong type or out of range, a bad image, over a limit); 404 unknown ``model`` (code
``model_not_found``); 413 body over ``max_request_bytes``.

Every answer carries an extension field ``specula``: ``{"finish_reason": "eos" | "stop" | "length",
"metrics": {tau, alpha, draft_tokens, accepted_tokens, time_s, drafter (the name of the one that drafted), ...},
"drafter": "ok" | "off" | "fallback: ..."}``
(streamed: in the chunk with ``finish_reason``). A streamed answer's deltas concatenate to exactly the content of
the same request unstreamed (same seed): both come from the same ``Detokenizer``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.errors import RequestError

SSE_DONE = b"data: [DONE]\n\n"
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def sse(obj: dict) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    """Unknown fields are refused, and so is any value of the wrong JSON type: booleans must be true/false, integers
    JSON integers, numbers JSON numbers (``"stream": "yes"``, ``"max_tokens": "10"`` or ``"n": true`` are 400s, as
    ``"max_tokens": "ten"`` is), never coerced."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = Field(False, description="A last chunk with usage and no choices.")
    include_obfuscation: StrictBool | None = Field(None, description="Accepted, no effect (no obfuscation padding).")


class _Common(_Strict):
    model: str | None = Field(None, description="The served model id (GET /v1/models); null = it.")
    max_tokens: StrictInt | None = Field(None, ge=1, description="New tokens at most.")
    temperature: StrictFloat | None = Field(None, ge=0, le=100, description="0 = greedy; default 1.0.")
    top_p: StrictFloat | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    top_k: StrictInt | None = Field(None, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = off.")
    min_p: StrictFloat | None = Field(None, ge=0, lt=1, description="Extension: drop tokens below min_p * max p.")
    seed: StrictInt | None = Field(None, ge=0, lt=2**64, description="Seeds the request's sampler.")
    stop: str | list[str] | None = Field(None, description="Strings that end the answer (not included).")
    n: StrictInt | None = Field(None, ge=1, description="Choices per request: 1 only.")
    stream: StrictBool | None = Field(False, description="Server-Sent Events, then data: [DONE].")
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = Field(None, description="Accepted, no effect.")
    drafter: str | None = Field(None, description="Extension: the drafter to speculate with, by name (GET /v1/models "
                                                  "lists them as `drafters`); null = the deployment's default.")


class ChatBody(_Common):
    messages: list[Any] = Field(min_length=1, description="The conversation (validated in OpenAIApi._messages).")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="New tokens at most (OpenAI's newer name).")
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class CompletionBody(_Common):
    prompt: str | list[Any] = Field(description="One text prompt, or one prompt as token ids.")
    logprobs: Any = None
    echo: StrictBool | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None


_NOOP = {  # field -> (is it harmless?, what we say)
    "n": (lambda v: v in (None, 1), "only n=1 is supported"),
    "logprobs": (lambda v: v in (None, False), "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported"),
    "tools": (lambda v: v in (None, []), "tools are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tools are not supported"),
    "functions": (lambda v: v in (None, []), "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "only text responses are supported"),
    "presence_penalty": (lambda v: v in (None, 0), "penalties are not supported (they would change p)"),
    "frequency_penalty": (lambda v: v in (None, 0), "penalties are not supported (they would change p)"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
}
_MESSAGE_NOOP = ("tool_calls", "function_call", "refusal", "audio", "tool_call_id")  # fine while empty
_TYPE_LOC = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*|constrained-.*|lax-.*|json-.*)$")


@dataclass(frozen=True)
class Plan:
    """A parsed, checked OpenAI request; ``OpenAIApi.prepare`` turns it into the GenerationRequest."""

    kind: str  # "chat" | "completions"
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list = field(default_factory=list)  # chat: the processor's format, one {"type": "image"} per image
    images: tuple[tuple[str, str], ...] = ()  # chat: (url, the field it came from), in order
    prompt: str | list[int] | None = None  # completions
    drafter: str | None = None  # the request's drafter choice (None = the default)


# ----------------------------------------------------------------------------------------------- requests


class OpenAIApi:
    """The translation over one ``IngressEngine`` (its limits, processor, model name and drafter kind)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [self._model()]}

    def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self._model()

    def _model(self) -> dict:
        return {"id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "specula",
                "drafters": list(self.engine.drafters)}  # extension: what a request's `drafter` may name

    def check_model(self, model_id: str | None) -> None:
        if model_id is not None and model_id != self.engine.model_name:
            raise RequestError(f"The model `{model_id}` does not exist (this server serves "
                               f"`{self.engine.model_name}`)", "model", 404, "model_not_found")

    def parse(self, kind: str, raw: bytes | str | dict) -> Plan:
        """A request body -> a Plan; RequestError (400/404/413, naming the field) if it cannot run."""
        schema = {"chat": ChatBody, "completions": CompletionBody}[kind]
        data = self.engine.load_json(raw)
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        for name in body.model_fields_set:
            rule = _NOOP.get(name)
            if rule is not None and not rule[0](getattr(body, name)):
                raise RequestError(f"{name}: {rule[1]}", name)
        self.check_model(body.model)
        drafter = self.engine.check_drafter(body.drafter)
        params = self._params(body, kind)
        stream = bool(body.stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream_options is not None and not stream:
            raise RequestError("stream_options: only allowed with stream: true", "stream_options")
        if kind == "chat":
            messages, images = self._messages(body.messages)
            return Plan(kind, params, stream, include_usage, messages, images, drafter=drafter)
        return Plan(kind, params, stream, include_usage, prompt=self._prompt(body.prompt), drafter=drafter)

    def prepare(self, plan: Plan, request_id: str) -> GenerationRequest:
        """Images + template + tokens (blocking: decode and tokenize; run off the event loop)."""
        if plan.kind == "completions":
            return self.engine.prepare_text(plan.prompt, plan.params, request_id, drafter=plan.drafter)
        images = [self.engine.images.from_url(url, where) for url, where in plan.images]
        return self.engine.prepare_chat(plan.messages, images, plan.params, request_id, drafter=plan.drafter)

    def shaper(self, plan: Plan, request: GenerationRequest) -> Shaper:
        return Shaper(plan.kind, self.engine.model_name, request.request_id, int(request.input_ids.numel()),
                      plan.include_usage)

    # ------------------------------------------------------------------------------------------- pieces

    def _params(self, body: _Common, kind: str) -> SamplingParams:
        max_tokens = body.max_tokens
        if kind == "chat" and body.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != body.max_completion_tokens:
                raise RequestError("max_tokens and max_completion_tokens disagree; give one", "max_completion_tokens")
            max_tokens = body.max_completion_tokens
            self.engine.check_max_tokens(max_tokens, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = self.engine.limits.max_tokens if kind == "chat" else min(16, self.engine.limits.max_tokens)
        self.engine.check_max_tokens(max_tokens)
        stop = body.stop
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop or [])
        if len(stop) > 16 or any(not s or len(s) > 256 for s in stop):
            raise RequestError("stop: at most 16 non-empty strings of at most 256 characters", "stop")
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=tuple(stop))

    def _messages(self, messages: list) -> tuple[list[dict], tuple[tuple[str, str], ...]]:
        """OpenAI messages -> the processor's chat format and the image URLs, every field checked by name."""
        token = self.engine.image_token
        out, images = [], []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise RequestError(f"{where}: must be an object", where)
            role = m.get("role")
            if role == "tool" or role == "function":
                raise RequestError(f"{where}.role: {role!r} messages are not supported (no tools)", f"{where}.role")
            if not isinstance(role, str) or role not in _ROLES:
                raise RequestError(f"{where}.role: must be one of {sorted(_ROLES)}, got {role!r}", f"{where}.role")
            for key, value in m.items():
                if key in ("role", "content", "name"):
                    continue
                if key in _MESSAGE_NOOP and not value:
                    continue
                why = "not supported" if key in _MESSAGE_NOOP else "unknown field"
                raise RequestError(f"{where}.{key}: {why}", f"{where}.{key}")
            content = m.get("content")
            if content is None:
                if role != "assistant":
                    raise RequestError(f"{where}.content: required", f"{where}.content")
                content = ""
            if isinstance(content, str):
                if token in content:
                    raise RequestError(f"{where}.content: contains the image token {token!r}; send images as "
                                       "image_url parts", f"{where}.content")
                out.append({"role": _ROLES[role], "content": content})
                continue
            if not isinstance(content, list):
                raise RequestError(f"{where}.content: must be a string or a list of parts", f"{where}.content")
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text = part.get("text")
                    if not isinstance(text, str) or set(part) - {"type", "text"}:
                        raise RequestError(f"{pw}: a text part is {{\"type\": \"text\", \"text\": \"...\"}}", pw)
                    if token in text:
                        raise RequestError(f"{pw}.text: contains the image token {token!r}; send images as "
                                           "image_url parts", f"{pw}.text")
                    parts.append({"type": "text", "text": text})
                elif kind == "image_url":
                    if role != "user":
                        raise RequestError(f"{pw}: images are only accepted in user messages", pw)
                    iu = part.get("image_url")
                    if isinstance(iu, str):
                        iu = {"url": iu}
                    if (set(part) - {"type", "image_url"} or not isinstance(iu, dict)
                            or not isinstance(iu.get("url"), str) or not iu["url"]
                            or set(iu) - {"url", "detail"} or iu.get("detail") not in (None, "auto", "low", "high")):
                        raise RequestError(f"{pw}: an image part is {{\"type\": \"image_url\", \"image_url\": "
                                           "{\"url\": \"data:image/png;base64,...\", \"detail\": \"auto\"}}", pw)
                    images.append((iu["url"], f"{pw}.image_url.url"))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"{pw}.type: {kind!r} parts are not supported (text and image_url are)",
                                       f"{pw}.type")
            out.append({"role": _ROLES[role], "content": parts})
        if len(images) > self.engine.limits.max_images:
            raise RequestError(f"{len(images)} images > max_images={self.engine.limits.max_images}", "messages")
        return out, tuple(images)

    @staticmethod
    def _prompt(prompt, nested: bool = False) -> str | list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt: empty", "prompt")
            return prompt
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)) and not nested:  # a batch of one: one level
            return OpenAIApi._prompt(prompt[0], nested=True)
        raise RequestError("prompt: one prompt per request (a string, or a list of token ids)", "prompt")


def _validation_error(e: ValidationError) -> RequestError:
    msgs, first = [], None
    for err in e.errors():
        loc = _loc([p for p in err["loc"] if not (isinstance(p, str) and _TYPE_LOC.match(p))])
        text = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        line = f"{loc or 'body'}: {text}"
        if line not in msgs:
            msgs.append(line)
        if first is None:
            first = loc or None
    return RequestError("; ".join(msgs[:4]), first, 400)


def _loc(loc) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# ----------------------------------------------------------------------------------------------- responses


class Shaper:
    """One answer in OpenAI's shapes, from ``Detokenizer`` chunks (``{"tokens", "text", "finished", ...}``).

    ``add`` returns the stream objects a chunk produces (chat's first call also emits the role chunk); ``result``
    the whole object once the last chunk is in. Both build on the same text, so they agree.
    """

    def __init__(self, kind: str, model: str, request_id: str, prompt_tokens: int, include_usage: bool) -> None:
        self.kind, self.model, self.include_usage = kind, model, include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.created = int(time.time())
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.text = ""
        self.final: dict | None = None  # the last chunk
        self._started = False

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def extension(self) -> dict:
        f = self.final or {}
        return {"finish_reason": f.get("finish_reason"), "metrics": f.get("metrics"), "drafter": f.get("drafter")}

    def add(self, chunk: dict) -> list[dict]:
        if chunk["finished"] and chunk["finish_reason"] not in _FINISH:  # "cancelled" by the server: not an answer
            raise RequestError(f"the server stopped this generation ({chunk['finish_reason']})", status=503)
        self.completion_tokens += len(chunk["tokens"])
        self.text += chunk["text"]
        out = []
        if not self._started and self.kind == "chat":
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        self._started = True
        if chunk["text"]:
            out.append(self._chunk({"content": chunk["text"]} if self.kind == "chat" else chunk["text"], None))
        if chunk["finished"]:
            self.final = chunk
            last = self._chunk({} if self.kind == "chat" else "", _FINISH[chunk["finish_reason"]])
            last["specula"] = self.extension()
            out.append(last)
            if self.include_usage:
                out.append({**self._head(), "choices": [], "usage": self.usage})
        return out

    def result(self) -> dict:
        if self.final is None:
            raise RuntimeError("the verifier stream ended without a finished chunk")
        reason = _FINISH[self.final["finish_reason"]]
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text, "refusal": None},
                      "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage, "specula": self.extension()}

    def _head(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, delta, finish_reason) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        out = {**self._head(), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out


# ----------------------------------------------------------------------------------------------- examples


def http_examples(config, image: str | None = None) -> str:
    """Copy-paste examples for a served config (what ``specula serve`` prints): curl, curl streaming, and the
    official openai client. With auth keys configured they read the key from ``$SPECULA_API_KEY``."""
    import shlex
    from pathlib import Path

    if image is None:
        import specula.world

        image = str(Path(specula.world.__file__).parent / "assets" / "sample.png")
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::", "") else config.http.host
    base = f"http://{host}:{config.http.port}{config.http.route_prefix.rstrip('/')}"
    from specula.runtime.serve.ingress import served_model_name

    model = served_model_name(config)
    auth = bool(config.auth.api_keys or config.auth.api_keys_env)
    key_header = ' -H "Authorization: Bearer $SPECULA_API_KEY"' if auth else ""

    def body(stream: bool) -> str:
        # the image goes in through the shell: '...'"$(base64 -w0 IMG)"'...'
        head = json.dumps({"model": model, "max_tokens": 32, **({"stream": True} if stream else {})})[:-1]
        return (f"'{head}, \"messages\": [{{\"role\": \"user\", \"content\": [{{\"type\": \"image_url\", "
                f"\"image_url\": {{\"url\": \"data:image/png;base64,'\"$(base64 -w0 {shlex.quote(image)})\"'\"}}}}, "
                f"{{\"type\": \"text\", \"text\": \"What colour is the circle?\"}}]}}]}}'")

    key = 'os.environ["SPECULA_API_KEY"]' if auth else '"none"'
    py = (f'import os; from openai import OpenAI; c = OpenAI(base_url="{base}/v1", api_key={key}); '
          f'r = c.chat.completions.create(model="{model}", max_tokens=32, '
          'messages=[{"role": "user", "content": "How much is 8 times 0?"}]); print(r.choices[0].message.content)')
    lines = [
        "HTTP (OpenAI-compatible; also GET /v1/models, /health, /metrics; POST /v1/completions, /generate):",
        f"  curl -sS {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} -d {body(False)}",
        f"  curl -sS -N {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} -d {body(True)}",
        f"  python -c {shlex.quote(py)}",
    ]
    if auth:
        lines.append("  (auth is on: export SPECULA_API_KEY=<one of your keys>)")
    return "\n".join(lines)
