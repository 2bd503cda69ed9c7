"""The four Serve deployments: thin shims over the engines (vision.py, dataplane/, verifier.py, ingress.py).

Each takes the config (as a dict: it crosses to the replica) and an injectable ``engine_cls`` with a
``from_config`` constructor, so the engine runs in-process without Ray in tests (``LocalApp``) and here in a replica.
Only ``builder.build_app`` binds them. Request flow (docs/design.md, "One request, end to end")::

    HTTP /v1/chat/completions, /v1/completions, /generate -> Ingress: auth, admission, validate, chat template,
                                                              tokens, pixels (http_api.py, openai_api.py, ingress.py)
        -> VisionEncoder.encode (batched across requests)     -> projected visual features
        -> TargetVerifier.generate (streaming)                 the request's decode loop, KV cache pinned here
               <-> DrafterEnsemble replica over one gRPC Session stream (its address from DrafterEnsemble.address)
    <- JSON / SSE chunks / NDJSON records

HTTP reaches the Ingress through Serve's proxy, or with ``http.direct`` on the replica's own port (direct_http.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from specula.runtime.config import load_config
from specula.runtime.dataplane import DrafterServer
from specula.runtime.engine.compute_thread import compute_thread
from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.serve.admission import Admission
from specula.runtime.serve.http_api import HttpApi
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.prometheus import GenerationMeter, ServeMetrics
from specula.runtime.serve.verifier import VerifierEngine, VerifierError
from specula.runtime.serve.vision import VisionEngine

log = logging.getLogger("ray.serve")
_WILDCARD = ("0.0.0.0", "::", "")


@serve.deployment
class VisionEncoder:
    """Pixels -> projected visual features; concurrent requests' images share one forward pass."""

    def __init__(self, config: dict, engine_cls=VisionEngine) -> None:
        self.config = load_config(config)
        self.compute = compute_thread()  # the tower is loaded and run on it: one torch thread per process
        self.engine = self.compute.call(engine_cls.from_config, self.config)
        s = self.config.deployments.vision_encoder
        self._batched.set_max_batch_size(s.max_batch_size)
        self._batched.set_batch_wait_timeout_s(s.batch_wait_timeout_s)

    async def encode(self, pixel_values, image_grid_thw=None):
        return await self._batched((pixel_values, image_grid_thw))

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _batched(self, items: list[tuple]) -> list:
        # one batch at a time (serve.batch default), on the thread the tower was loaded on
        return await self.compute.acall(self.engine.encode_many, items)

    def placement(self) -> dict:
        return _placement(self.config.deployments.vision_encoder.device)


@serve.deployment
class DrafterEnsemble:
    """Runs a DrafterService gRPC server in the replica; verifiers ask ``address`` and open a session there."""

    def __init__(self, config: dict, engine_cls=DrafterServer) -> None:
        self.config = load_config(config)
        from specula.runtime.engine.factory import set_threads

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

    def placement(self) -> dict:
        return _placement(self.config.deployments.drafter_ensemble.device)

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

    def placement(self) -> dict:
        return _placement(self.config.deployments.target_verifier.device)

    def live_requests(self) -> list[str]:
        """Request ids whose KV cache this replica holds now (what a cancellation must free)."""
        for _ in range(10):  # the loop thread may change the set while we copy it
            try:
                return list(self.engine.target.live_ids)
            except RuntimeError:
                continue
        return list(self.engine.target.live_ids)

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
    """The HTTP front door: OpenAI routes, ``POST /generate``, /health, /metrics (routing in http_api.py), behind
    Serve's proxy or, with ``http.direct``, on this replica's own port (direct_http.py).

    The seam every front door of this replica shares (the public gRPC API, grpc_api.py, plugs in here), so HTTP
    and gRPC requests wait in one admission queue and count in one set of metrics:

    - ``self.engine``: the ``IngressEngine`` (validation, chat template, tokens, images, ``detokenizer``,
      ``model_name``, ``check_drafter``).
    - ``self.admission``: the replica's ``Admission``; hold ``async with self.admission.slot()`` around a
      generation (``Overloaded`` when full).
    - ``self.metrics``: the replica's ``ServeMetrics`` (``request(route, code)`` for a door's status counts).
    - ``run(request)``: async iterator of the verifier's chunks ``{"tokens", "finished", "finish_reason"[,
      "metrics", "drafter"]}`` for a prepared ``GenerationRequest`` (vision encode + the verifier's stream; stop
      strings are stripped for the verifier, match them with ``engine.detokenizer(request)``). Generation metrics
      are recorded here. Leave it early with ``aclose()`` (or by cancelling the task) and the verifier request is
      cancelled, its KV cache freed. Raises the verifier's ``VerifierError`` (not Ray's wrapper) on failure.
    """

    def __init__(self, config: dict, vision, verifier, engine_cls=IngressEngine, drafter=None,
                 verifier_cls=VerifierEngine) -> None:
        # vision: the VisionEncoder's handle, or None when the verifier encodes images (vision_encoder.colocate);
        # verifier: the TargetVerifier's handle, or None when its engine runs here (target_verifier.in_ingress),
        # built from verifier_cls with drafter (the DrafterEnsemble's handle, or None) as a TargetVerifier would
        self.config = load_config(config)
        self.engine = engine_cls.from_config(self.config)
        self.vision, self.verifier = vision, verifier
        self.hosted = None
        if verifier is None:  # after the ingress engine: the verifier's torch threads are the ones that stay set
            self.hosted = TargetVerifier.func_or_class(config, drafter, engine_cls=verifier_cls)
        limits = self.config.limits
        self.admission = Admission(limits.max_concurrent_requests, limits.max_queued_requests)
        self.metrics = ServeMetrics(self.admission)
        self.http = HttpApi(self.config, self.engine, self.admission, self.metrics, self.run)
        self.grpc = None
        if self.config.grpc.enabled:  # the public gRPC API, served from this replica's event loop (grpc_api.py)
            from specula.runtime.serve.grpc_api import PublicApiServicer, serve_in_running_loop

            servicer = PublicApiServicer.from_config(self.config, self.engine, self.run, self.admission, self.metrics)
            self.grpc = serve_in_running_loop(self.config, servicer)
        self.direct = None
        if self.config.http.direct:  # this replica listens on http.host:http.port itself (direct_http.py)
            from specula.runtime.serve.direct_http import DirectHttp

            h = self.config.http
            self.direct = DirectHttp(self.http, h.host, h.port, h.route_prefix)

    def grpc_address(self) -> str | None:
        """host:port of this replica's public gRPC API (None when grpc.enabled is false)."""
        return self.grpc.address if self.grpc is not None else None

    def live_requests(self) -> list[str]:
        """Request ids whose KV cache the verifier inside this replica holds (target_verifier.in_ingress)."""
        if self.hosted is None:
            raise RuntimeError("the verifier runs in the TargetVerifier deployment: ask its replicas")
        return self.hosted.live_requests()

    def check_health(self) -> None:
        if self.hosted is not None:  # Serve restarts the replica when its verifier loop died
            self.hosted.check_health()

    def __del__(self) -> None:
        if getattr(self, "direct", None) is not None:
            self.direct.close()
        if getattr(self, "grpc", None) is not None:
            self.grpc.close()
        if getattr(self, "hosted", None) is not None:
            self.hosted.__del__()

    async def __call__(self, http: Request) -> Response:
        return await self.http(http)

    async def run(self, request: GenerationRequest) -> AsyncIterator[dict]:
        request = IngressEngine.upstream(request)
        visual = None
        if request.pixel_values is not None and self.vision is not None:  # not awaited: Serve hands the result
            # straight to the verifier; with no VisionEncoder (vision_encoder.colocate) the verifier encodes them
            visual = self.vision.encode.remote(request.pixel_values, request.image_grid_thw)
        if self.hosted is not None:  # no Ray call: the verifier's engine is in this process
            if visual is not None:  # what Serve resolves for a TargetVerifier, resolved here
                visual = await visual
            chunks = _Hosted(self.hosted.generate(request, visual))
        else:
            chunks = self.verifier.options(stream=True).generate.remote(request, visual)
        meter = GenerationMeter(self.metrics, int(request.input_ids.numel()))
        try:
            async for chunk in chunks:
                meter.add(chunk)
                yield chunk
                if chunk["finished"]:
                    return
            raise VerifierError("the verifier stream ended without a finished chunk")
        except Exception as e:
            meter.end("error")
            raise _cause(e) from None
        finally:
            meter.end("closed_early")  # the caller left: a stop string, a disconnect, a deadline
            if not meter.finished:
                chunks.cancel()  # stop the request's loop in the verifier, free its KV cache


class _Hosted:
    """The hosted verifier's async generator, with the ``cancel()`` of a Ray streaming response: cancelling closes
    it, which cancels the request in the engine (``VerifierEngine.astream``) and frees its KV cache."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self.agen.__aiter__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


def _placement(device: str) -> dict:
    """Where this replica runs: {"node_id", "gpu_ids" (Ray's, as CUDA_VISIBLE_DEVICES numbers them), "device",
    "pid"}; what a placement test or an operator asks a replica."""
    import os

    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "device": device, "pid": os.getpid()}


async def _resolve(response):
    return await response


def _cause(e: BaseException) -> BaseException:
    """The user-facing exception inside a Ray task error (e.g. the verifier's VerifierError)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
