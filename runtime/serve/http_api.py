"""The HTTP routes of an ingress replica, over Starlette requests (no Ray: the deployment hands each request here).

    POST /v1/chat/completions   OpenAI chat (openai_api.py): JSON, or SSE with stream: true, then data: [DONE]
    POST /v1/completions        OpenAI text completions
    GET  /v1/models[/{id}]      the served model
    POST /generate              the native API (ingress.py): JSON, or NDJSON records with stream: true
    GET  /health                200 while the replica serves (no token needed when auth.open_health)
    GET  /metrics               Prometheus text (prom.py)

Every route needs ``Authorization: Bearer <key>`` when keys are configured (auth.py). Errors are OpenAI's shape
(errors.py). A generation holds one slot of the replica's ``Admission`` (shared with gRPC) from admission to its
last byte; full -> 503 at once (with Retry-After). ``limits.request_timeout_s`` bounds a request from arrival to
its last token: past it the generation is cancelled (its KV cache freed) and the answer is 408, or, once a stream
has started, a last error event. A client that disconnects cancels its generation the same way: Serve cancels the
handler, which closes ``run`` (the verifier stream) and releases the slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specula.runtime.serve.admission import Admission, Overloaded
from specula.runtime.serve.auth import authorized
from specula.runtime.serve.errors import RequestError, error_body, error_record
from specula.runtime.serve.openai_api import SSE_DONE, OpenAIApi, sse
from specula.runtime.serve.prometheus import CONTENT_TYPE

log = logging.getLogger(__name__)
Run = Callable[..., AsyncIterator[dict]]


class HttpApi:
    """Routes one replica's HTTP requests. ``run(request)`` is the replica's generation seam (vision + verifier)."""

    def __init__(self, config, engine, admission: Admission, metrics, run: Run) -> None:
        self.engine, self.admission, self.metrics, self.run = engine, admission, metrics, run
        self.openai = OpenAIApi(engine)
        self.keys = config.auth.keys()
        self.open_health = config.auth.open_health
        self.timeout_s = config.limits.request_timeout_s
        self.max_body = config.limits.max_request_bytes
        jobs = {"/v1/chat/completions": _OpenAIJob(self.openai, "chat"),
                "/v1/completions": _OpenAIJob(self.openai, "completions"), "/generate": _GenerateJob(engine)}
        self.routes = {path: {"POST": partial(self._generation, job=job, route=path)} for path, job in jobs.items()}
        self.routes.update({"/v1/models": {"GET": self._models}, "/health": {"GET": self._health},
                            "/metrics": {"GET": self._metrics}})

    async def __call__(self, http: Request) -> Response:
        path = _path(http)
        route, methods = self._match(path)
        try:
            if not (path == "/health" and self.open_health) and not authorized(http.headers.get("authorization"),
                                                                                 self.keys):
                raise RequestError("missing or invalid API key: send 'Authorization: Bearer <key>'", status=401,
                                   code="invalid_api_key")
            if methods is None:
                raise RequestError(f"no route {path} (routes: {', '.join(sorted(self.routes))})", status=404,
                                   code="not_found")
            handler = methods.get(http.method)
            if handler is None:
                raise RequestError(f"{http.method} is not allowed on {route}; use {', '.join(methods)}", status=405,
                                   code="method_not_allowed")
            response = await handler(http)
        except Exception as e:  # noqa: BLE001 - every failure is an answer in OpenAI's shape
            response = self._failure(e)
            if response.status_code == 405:
                response.headers["Allow"] = ", ".join(methods)
        self.metrics.request(route, response.status_code)
        return response

    def _match(self, path: str) -> tuple[str, dict | None]:
        if path in self.routes:
            return path, self.routes[path]
        if path.startswith("/v1/models/"):
            model_id = path[len("/v1/models/"):]
            return "/v1/models/{id}", {"GET": lambda r: self._model(model_id)}
        return "unknown", None

    def _failure(self, e: BaseException) -> Response:
        e = _cause(e)
        headers = {}
        if isinstance(e, RequestError):
            status, body = e.status, error_record(e)
            if status == 401:
                headers["WWW-Authenticate"] = "Bearer"
        elif isinstance(e, Overloaded):
            status, body = 503, error_body(str(e), 503, code="server_overloaded")
            headers["Retry-After"] = "1"
        elif isinstance(e, TimeoutError) and self.timeout_s is not None:
            status, body = 408, error_body(self._timeout_message(), 408, code="request_timeout")
        else:
            log.error("request failed: %r", e)
            status, body = 500, error_record(e, 500)
        return JSONResponse(body, status, headers=headers)

    def _timeout_message(self) -> str:
        return f"request_timeout_s={self.timeout_s:g} passed; the generation was cancelled"

    # ------------------------------------------------------------------------------------------- small routes

    async def _models(self, http: Request) -> Response:
        return JSONResponse(self.openai.models())

    async def _model(self, model_id: str) -> Response:
        return JSONResponse(self.openai.model(model_id))

    async def _health(self, http: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.engine.model_name})

    async def _metrics(self, http: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------------------------------- generation

    async def _generation(self, http: Request, *, job, route: str) -> Response:
        raw = await self._read_body(http)
        plan = await asyncio.to_thread(job.parse, raw)  # JSON + schema: cheap, but bodies carry images
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s if self.timeout_s is not None else None
        stack = AsyncExitStack()  # the admission slot, then the verifier stream: closed in reverse order
        streaming = False
        try:
            async with asyncio.timeout_at(deadline):
                t0 = time.perf_counter()
                await stack.enter_async_context(self.admission.slot())
                t1 = time.perf_counter()
                self.metrics.phase("queue", t1 - t0)
                request = await asyncio.to_thread(job.prepare, plan, uuid.uuid4().hex)
                if not job.stream(plan) and not request.params.stop:  # the answer is read only once it is whole
                    request = replace(request, streamed=False)
                self.metrics.phase("prepare", time.perf_counter() - t1)
                detok = self.engine.detokenizer(request)
                shape = job.shaper(plan, request)
                gen = self.run(request)
                stack.push_async_callback(gen.aclose)  # leaving early cancels the verifier request
                if not job.stream(plan):
                    async for chunk in gen:
                        out = detok.add(chunk)
                        shape.add(out)
                        if out["finished"]:
                            break
                    return JSONResponse(shape.result())
                first = detok.add(await anext(gen))  # prefill errors and timeouts still get their status
                streaming = True
        finally:
            if not streaming:
                await stack.aclose()
        events = self._events(first, gen, detok, shape, deadline, route)
        return _ClosingStream(events, stack.aclose, media_type=job.media_type,
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, chunk: dict, gen, detok, shape, deadline, route: str) -> AsyncIterator[bytes]:
        """The stream's bytes; a failure after the first byte is a last error event (never a finished one)."""
        try:
            while True:
                for piece in shape.encode(chunk):
                    yield piece
                if chunk["finished"]:
                    yield shape.trailer
                    return
                async with asyncio.timeout_at(deadline):
                    chunk = detok.add(await anext(gen))
        except TimeoutError:
            self.metrics.stream_error(route, 408)
            yield shape.error(error_body(self._timeout_message(), 408, code="request_timeout"))
        except Exception as e:  # noqa: BLE001 - the verifier failed mid-answer
            e = _cause(e)
            log.error("stream failed: %r", e)
            status = e.status if isinstance(e, RequestError) else 500
            self.metrics.stream_error(route, status)
            yield shape.error(error_record(e, status))

    async def _read_body(self, http: Request) -> bytes:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise RequestError(f"request body of {declared} bytes > max_request_bytes={self.max_body}", status=413)
        buf = bytearray()
        async for part in http.stream():
            buf += part
            if len(buf) > self.max_body:
                raise RequestError(f"request body > max_request_bytes={self.max_body}", status=413)
        return bytes(buf)


# ----------------------------------------------------------------------------------------------- the two APIs


class _OpenAIJob:
    """/v1/chat/completions and /v1/completions: SSE chunk objects, then ``data: [DONE]``."""

    media_type = "text/event-stream"

    def __init__(self, api: OpenAIApi, kind: str) -> None:
        self.api, self.kind = api, kind

    def parse(self, raw: bytes):
        return self.api.parse(self.kind, raw)

    def prepare(self, plan, request_id: str):
        return self.api.prepare(plan, request_id)

    @staticmethod
    def stream(plan) -> bool:
        return plan.stream

    def shaper(self, plan, request):
        return _SseShape(self.api.shaper(plan, request))


class _SseShape:
    trailer = SSE_DONE

    def __init__(self, shaper) -> None:
        self.shaper = shaper

    def add(self, chunk: dict) -> None:
        self.shaper.add(chunk)

    def encode(self, chunk: dict) -> list[bytes]:
        return [sse(obj) for obj in self.shaper.add(chunk)]

    def result(self) -> dict:
        return self.shaper.result()

    @staticmethod
    def error(body: dict) -> bytes:
        return sse(body)  # the openai client raises APIError on an event with "error"


class _GenerateJob:
    """POST /generate: NDJSON records (ingress.Response)."""

    media_type = "application/x-ndjson"

    def __init__(self, engine) -> None:
        self.engine = engine

    def parse(self, raw: bytes):
        return self.engine.parse(raw)

    def prepare(self, body, request_id: str):
        return self.engine.prepare(body, request_id)

    @staticmethod
    def stream(body) -> bool:
        return body.stream

    def shaper(self, body, request):
        return _NdjsonShape(self.engine.response(request))


class _NdjsonShape:
    trailer = b""

    def __init__(self, response) -> None:
        self.response = response

    def add(self, chunk: dict) -> None:
        self.response.add(chunk)

    def encode(self, chunk: dict) -> list[bytes]:
        return [json.dumps(r).encode() + b"\n" for r in self.response.add(chunk)]

    def result(self) -> dict:
        return self.response.result()

    @staticmethod
    def error(body: dict) -> bytes:
        return json.dumps(body).encode() + b"\n"


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always runs ``close`` (cancel the verifier request, free the admission slot) when
    it ends: finished, failed, or cancelled because the client went away, even before the first byte. Should the
    server drop it without ever sending it, its finalizer schedules the same cleanup on the event loop."""

    def __init__(self, content, close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._close, self._closed = close, False
        self._loop = asyncio.get_running_loop()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._finish()

    async def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.body_iterator.aclose()
        finally:
            await self._close()

    def __del__(self) -> None:
        if not self._closed and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._finish()))


def _path(http: Request) -> str:
    path = http.url.path
    root = http.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return "/" + path.strip("/")


def _cause(e: BaseException) -> BaseException:
    """The user-facing exception inside a Ray task error (e.g. the verifier's VerifierError)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
