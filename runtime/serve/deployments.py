"""The four Serve deployments: thin shims over the engines (vision.py, dataplane/, verifier.py, ingress.py).

Each takes the config (as a dict: it crosses to the replica) and an injectable ``engine_cls`` with a
``from_config`` constructor, so the engine runs in-process without Ray in tests (``LocalApp``) and here in a replica.
Only ``builder.build_app`` binds them. Request flow (DESIGN.md "One request, end to end")::

    HTTP POST /generate -> Ingress: validate, chat template, tokens, pixels
        -> VisionEncoder.encode (batched across requests)     -> projected visual features
        -> TargetVerifier.generate (streaming)                 the request's decode loop, KV cache pinned here
               <-> DrafterEnsemble replica over one gRPC Session stream (its address from DrafterEnsemble.address)
    <- NDJSON records / one JSON object
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specula.runtime.config import load_config
from specula.runtime.dataplane import DrafterServer
from specula.runtime.serve.ingress import IngressEngine, RequestError, error_record
from specula.runtime.serve.verifier import VerifierEngine
from specula.runtime.serve.vision import VisionEngine

log = logging.getLogger("ray.serve")
_WILDCARD = ("0.0.0.0", "::", "")


@serve.deployment
class VisionEncoder:
    """Pixels -> projected visual features; concurrent requests' images share one forward pass."""

    def __init__(self, config: dict, engine_cls=VisionEngine) -> None:
        self.config = load_config(config)
        self.engine = engine_cls.from_config(self.config)
        s = self.config.deployments.vision_encoder
        self._batched.set_max_batch_size(s.max_batch_size)
        self._batched.set_batch_wait_timeout_s(s.batch_wait_timeout_s)

    async def encode(self, pixel_values, image_grid_thw=None):
        return await self._batched((pixel_values, image_grid_thw))

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _batched(self, items: list[tuple]) -> list:
        return await asyncio.to_thread(self.engine.encode_many, items)  # one batch at a time (serve.batch default)


@serve.deployment
class DrafterEnsemble:
    """Runs a DrafterService gRPC server in the replica; verifiers ask ``address`` and open a session there."""

    def __init__(self, config: dict, engine_cls=DrafterServer) -> None:
        self.config = load_config(config)
        from specula.runtime.serve.factory import set_threads

        set_threads(self.config.deployments.drafter_ensemble)
        advertise = None
        if self.config.dataplane.host in _WILDCARD and self.config.dataplane.advertise_host is None:
            import ray

            advertise = ray.util.get_node_ip_address()
        self.server = engine_cls.from_config(self.config, advertise_host=advertise)
        self.server.start()

    def address(self) -> str:
        """host:port of this replica's DrafterService (Serve's routing picks the replica)."""
        return self.server.address

    def check_health(self) -> None:
        self.server.check_health()

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace=1.0)


@serve.deployment
class TargetVerifier:
    """Each request's decode loop as one streaming call; the request's KV cache lives in this replica."""

    def __init__(self, config: dict, drafter=None, engine_cls=VerifierEngine) -> None:
        self.config = load_config(config)
        self.engine = engine_cls.from_config(self.config)
        self.drafter = drafter  # DeploymentHandle of DrafterEnsemble, or None (plain decoding)

    async def generate(self, request, visual=None):
        """Chunks {"tokens", "finished", "finish_reason"[, "metrics", "drafter"]}; raises VerifierError."""
        if visual is not None:
            request = replace(request, visual=visual)
        address = await self._drafter_address()
        async for chunk in self.engine.astream(request, drafter_address=address):
            yield chunk

    async def _drafter_address(self) -> str | None:
        if self.drafter is None or getattr(self.engine, "remote", None) is None:
            return None
        response = self.drafter.address.remote()
        try:
            return await asyncio.wait_for(_resolve(response), self.config.drafter.address_timeout_s)
        except Exception as e:  # no drafter replica in time: this request decodes alone
            response.cancel()
            log.warning("no drafter address (%r); decoding alone", e)
            return None

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


@serve.deployment
class Ingress:
    """``POST {route_prefix}generate``: JSON in, JSON or NDJSON out (see ingress.py for the schema)."""

    def __init__(self, config: dict, vision, verifier, engine_cls=IngressEngine) -> None:
        self.config = load_config(config)
        self.engine = engine_cls.from_config(self.config)
        self.vision, self.verifier = vision, verifier

    async def __call__(self, http: Request) -> Response:
        path = http.url.path
        root = http.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.rstrip("/") != "/generate":
            return JSONResponse({"error": {"type": "NotFound", "message": f"no route {path}; POST /generate"}}, 404)
        if http.method != "POST":
            return JSONResponse({"error": {"type": "MethodNotAllowed", "message": "use POST"}}, 405)
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.config.limits.max_request_bytes:
            return JSONResponse(error_record(RequestError("request body too large")), 413)
        raw = await http.body()
        try:  # JSON, base64, PNG decoding and tokenization: off the event loop
            body, request = await asyncio.to_thread(self._prepare, raw)
        except RequestError as e:
            return JSONResponse(error_record(e), 400)
        visual = None
        if request.pixel_values is not None:  # not awaited: Serve hands the result straight to the verifier
            visual = self.vision.encode.remote(request.pixel_values, request.image_grid_thw)
        chunks = self.verifier.options(stream=True).generate.remote(request, visual)
        response = self.engine.response(request)
        try:
            first = await chunks.__anext__()  # prefill errors still get an HTTP status
        except Exception as e:
            chunks.cancel()
            return JSONResponse(error_record(_cause(e)), 500)
        if body.stream:
            return StreamingResponse(_ndjson(first, chunks, response), media_type="application/x-ndjson")
        try:
            response.add(first)
            async for chunk in chunks:
                response.add(chunk)
            return JSONResponse(response.result())
        except Exception as e:
            chunks.cancel()
            return JSONResponse(error_record(_cause(e)), 500)

    def _prepare(self, raw: bytes):
        body = self.engine.parse(raw)
        return body, self.engine.prepare(body, uuid.uuid4().hex)


async def _ndjson(first, chunks, response):
    import json

    finished = False
    try:
        for record in response.add(first):
            yield json.dumps(record) + "\n"
        finished = first["finished"]
        async for chunk in chunks:
            for record in response.add(chunk):
                yield json.dumps(record) + "\n"
            finished = chunk["finished"]
    except Exception as e:  # after the first byte: an error record, and no "finished" record
        yield json.dumps(error_record(_cause(e))) + "\n"
    finally:
        if not finished:
            chunks.cancel()  # the client left (or the verifier failed): stop the request's loop


async def _resolve(response):
    return await response


def _cause(e: BaseException) -> BaseException:
    """The user-facing exception inside a Ray task error (e.g. the verifier's VerifierError)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
