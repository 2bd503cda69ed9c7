"""The public gRPC API (protos/specula_api.proto): ``Generate``, ``GenerateStream``, ``ListModels``, plus standard
health checking and server reflection, on a ``grpc.aio`` server in the ingress's event loop.

The servicer does no model work itself; it is built over the ingress's three seams, so the same code runs in a
Ray Serve Ingress replica and in one process (tests, ``local_run``)::

    servicer = PublicApiServicer.from_config(config, engine, run, admission)
    server = await start_grpc_server(config, servicer)      # in the loop that will serve it
    ...
    await server.stop(grace=2.0)

    # or from synchronous code running in that loop, e.g. a Serve replica's constructor (Ray Serve 2.60 runs it
    # on the replica's user-code event loop, where its request handlers run too):
    server = serve_in_running_loop(config, servicer)        # binds now (errors raise here), starts as a task
    server.close()                                          # from the replica's __del__

    engine     IngressEngine: ``parse`` (validation, RequestError naming the field), ``prepare`` (chat template,
               tokens, pixels -> GenerationRequest), ``detokenizer`` (verifier chunks -> text deltas, stop
               strings), ``upstream`` (the request the verifier runs), ``check_drafter``, ``model_name``
    run        GenerationRequest -> async iterator of verifier chunks {"tokens", "finished", "finish_reason"[,
               "metrics", "drafter"]}; leaving it early (``aclose``) cancels the request and frees its KV cache
    admission  the replica's Admission, shared with HTTP: ``Overloaded`` -> RESOURCE_EXHAUSTED

Status codes (also in the .proto): INVALID_ARGUMENT for a bad field (named in the message) or bytes that are not
the request message (``DecodeGuard``), NOT_FOUND for an
unknown model, UNAUTHENTICATED without a valid bearer token (``AuthInterceptor``: every method, health checks
open when ``auth.open_health``), RESOURCE_EXHAUSTED under backpressure, DEADLINE_EXCEEDED when the client's
deadline or ``limits.request_timeout_s`` passes, CANCELLED when the client leaves; INTERNAL when the target fails.
In the last three cases the verifier request is cancelled (the handler's task is cancelled, which closes ``run``).

Stop strings are matched by the ingress's Detokenizer on the decoded text, as for HTTP: the verifier request is
cancelled at the first match and the text is cut before it; text that may begin a stop string is held back, so a
stream's concatenated text always equals the unary answer.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from specula.protos import load
from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.admission import Admission, Overloaded
from specula.runtime.serve.auth import authorized
from specula.runtime.serve.ingress import RequestError

log = logging.getLogger(__name__)
api = load("specula_api")
SERVICE = api.pb2.DESCRIPTOR.services_by_name["Specula"].full_name  # "specula.api.v1.Specula"
HEALTH_SERVICE = "grpc.health.v1.Health"
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
_NO_DEADLINE = 1e8  # grpc reports "no deadline" as a huge time_remaining (or None)

Run = Callable[[GenerationRequest], AsyncIterator[dict]]


class NotFound(RequestError):
    """A request names something this server does not have (NOT_FOUND; HTTP would say 404)."""

    status = 404


# ----------------------------------------------------------------------------------------------- the servicer


class PublicApiServicer(api.pb2_grpc.SpeculaServicer):
    """``specula.api.v1.Specula`` over an IngressEngine, a ``run`` callable and an Admission.

    Args:
        engine: the ingress's IngressEngine (its ``model_name``, ``drafter_kind`` and ``drafters`` are what
            ListModels reports).
        run: GenerationRequest -> async iterator of verifier chunks (vision encode + verifier stream).
        admission: the replica's Admission (shared with HTTP).
        limits: the config's LimitsConfig (max_tokens, max_images, request_timeout_s).
        gamma: draft tokens per block (reported by ListModels).
        metrics: the replica's ServeMetrics, or None: each call's status is counted as
            ``specula_requests_total{route="grpc:<Method>", code="<STATUS>"}``.
    """

    def __init__(self, engine, run: Run, admission: Admission, limits, gamma: int = 0, metrics=None) -> None:
        self.engine, self.run, self.admission, self.limits, self.gamma = engine, run, admission, limits, gamma
        self.metrics = metrics
        self.active = 0  # handlers between admission and their end (tests wait on it)

    @classmethod
    def from_config(cls, config, engine, run: Run, admission: Admission, metrics=None) -> PublicApiServicer:
        return cls(engine, run, admission, config.limits, config.drafter.gamma, metrics)

    # ------------------------------------------------------------------------------------------- methods

    async def Generate(self, request, context):
        chunks = []

        async def collect(chunk) -> None:
            chunks.append(chunk)

        await self._serve(request, context, collect, "Generate")
        last = chunks[-1]
        return api.pb2.GenerateResponse(
            id=last.id, text="".join(c.text for c in chunks), tokens=[t for c in chunks for t in c.tokens],
            finish_reason=last.finish_reason, usage=last.usage, metrics=last.metrics, drafter=last.drafter,
            model=self.engine.model_name)

    async def GenerateStream(self, request, context):
        await self._serve(request, context, context.write, "GenerateStream")

    async def ListModels(self, request, context):
        self._count("ListModels", grpc.StatusCode.OK)
        return api.pb2.ListModelsResponse(models=[api.pb2.Model(
            id=self.engine.model_name, drafter=self.engine.drafter_kind or "", gamma=self.gamma,
            max_tokens=self.limits.max_tokens, max_images=self.limits.max_images, drafters=self.engine.drafters)])

    # ------------------------------------------------------------------------------------------- one request

    async def _serve(self, request, context, emit: Callable[[object], Awaitable[None]], method: str) -> None:
        """Validate, admit, generate; every failure becomes its status code (``context.abort`` raises)."""
        code, timeout = None, None
        try:
            body, params = self._check(request)
            timeout = _deadline(context, self.limits.request_timeout_s)
            async with asyncio.timeout(timeout):
                async with self.admission.slot():
                    self.active += 1
                    try:
                        await self._generate(body, params, emit, whole=method == "Generate")
                    finally:
                        self.active -= 1
        except NotFound as e:
            code, message = grpc.StatusCode.NOT_FOUND, str(e)
        except RequestError as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Overloaded as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except TimeoutError:
            limit = f"deadline of {timeout:g} s" if timeout is not None else "deadline"
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"{limit} passed (client deadline or limits.request_timeout_s); the request was cancelled")
        except asyncio.CancelledError:
            # the client left or its deadline passed: grpc reports it; run was closed on the way out
            self._count(method, grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:  # noqa: BLE001 - the target failed: an error, never a short answer
            cause = _cause(e)
            log.error("gRPC request failed: %r", cause)
            code, message = grpc.StatusCode.INTERNAL, f"{type(cause).__name__}: {cause}"[:2000]
        self._count(method, code or grpc.StatusCode.OK)
        if code is not None:
            await context.abort(code, message)

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.request(f"grpc:{method}", code.name)

    def _check(self, request) -> tuple[dict, dict]:
        """Cheap checks before admission: the POST /generate body for IngressEngine.parse, and the sampling
        parameters that body does not carry (validated here by building a SamplingParams)."""
        if request.model and request.model != self.engine.model_name:
            raise NotFound(f"model: {request.model!r} is not served here; ListModels gives "
                           f"{self.engine.model_name!r}", "model")
        self.engine.check_drafter(request.drafter or None)
        if len(request.stop) > MAX_STOP:
            raise RequestError(f"stop: {len(request.stop)} strings > {MAX_STOP}", "stop")
        for i, s in enumerate(request.stop):
            if not s or len(s) > MAX_STOP_CHARS:
                raise RequestError(f"stop[{i}]: must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                                   f"stop[{i}]")
        if len(request.images) > self.limits.max_images:  # before base64-encoding them all
            raise RequestError(f"images: {len(request.images)} images > max_images={self.limits.max_images}",
                               "images")
        body: dict = {"prompt": request.prompt, "images": [base64.b64encode(b).decode() for b in request.images]}
        if request.drafter:  # checked above; the request carries it to the drafter replica
            body["drafter"] = request.drafter
        for name in ("temperature", "seed", "max_tokens"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        params = {name: getattr(request, name) for name in ("top_p", "top_k", "min_p") if request.HasField(name)}
        try:
            SamplingParams(temperature=body.get("temperature", 0.0), **params)
        except ValueError as e:
            message = str(e).removeprefix("SamplingParams.")
            raise RequestError(message, message.split(" ", 1)[0]) from None
        if request.stop:
            params["stop"] = tuple(request.stop)
        return body, params

    def _prepare(self, body: dict, extra: dict) -> GenerationRequest:
        """parse + prepare: images decode and the processor runs, so this is called off the event loop."""
        req = self.engine.prepare(self.engine.parse(body), uuid.uuid4().hex)
        return replace(req, params=replace(req.params, **extra)) if extra else req

    async def _generate(self, body: dict, extra: dict, emit, whole: bool = False) -> None:
        """``whole``: the caller reads the answer only once it is complete (unary Generate)."""
        req = await asyncio.to_thread(self._prepare, body, extra)
        if whole and not req.params.stop:  # no chunks between the first and the last (GenerationRequest.streamed)
            req = replace(req, streamed=False)
        detok = self.engine.detokenizer(req)  # text deltas and stop strings, as for HTTP
        stats = _Stats()
        chunks = self.run(self.engine.upstream(req))
        try:
            async for chunk in chunks:
                out = detok.add(chunk)
                msg = api.pb2.GenerateChunk(id=req.request_id, tokens=chunk["tokens"], text=out["text"],
                                            stats=stats.add(chunk))
                if out["finished"]:
                    metrics = out.get("metrics")
                    msg.finished, msg.finish_reason = True, out["finish_reason"] or ""
                    msg.usage.CopyFrom(api.pb2.Usage(prompt_tokens=int(req.input_ids.numel()),
                                                     completion_tokens=len(detok.tokens)))
                    msg.metrics.CopyFrom(_metrics(metrics) if metrics else stats.metrics(len(detok.tokens)))
                    msg.drafter = out.get("drafter") or ""
                await emit(msg)
                if msg.finished:
                    return
            raise RuntimeError("the verifier stream ended without a finished chunk")
        finally:
            await chunks.aclose()  # a stop string, an error or a cancellation: the verifier request is cancelled


# ----------------------------------------------------------------------------------------------- helpers


class _Stats:
    """Per-chunk stats. Every chunk after the first is one verification that emitted (accepted drafts + 1)
    tokens, except a final chunk cut by EOS or max_tokens, whose exact figures come with the verifier's metrics."""

    def __init__(self) -> None:
        self.chunks = self.blocks = self.accepted = 0

    def add(self, chunk: dict):
        first, n = self.chunks == 0, len(chunk["tokens"])
        self.chunks += 1
        accepted = 0
        m = chunk.get("metrics") if chunk["finished"] else None
        if m:
            accepted = max(0, m["accepted_tokens"] - self.accepted)
            self.blocks, self.accepted = m["blocks"], m["accepted_tokens"]
        elif not first and n:
            accepted = n - 1
            self.blocks += 1
            self.accepted += accepted
        return api.pb2.ChunkStats(accepted_tokens=accepted, tau=self.tau)

    @property
    def tau(self) -> float:
        return (self.accepted + self.blocks) / self.blocks if self.blocks else 0.0

    def metrics(self, emitted: int):
        """What is known when a stop string ended the request (the verifier's own metrics never came)."""
        return api.pb2.Metrics(blocks=self.blocks, accepted_tokens=self.accepted, emitted=emitted, tau=self.tau)


def _metrics(m: dict):
    return api.pb2.Metrics(blocks=m.get("blocks", 0), draft_tokens=m.get("draft_tokens", 0),
                           accepted_tokens=m.get("accepted_tokens", 0), emitted=m.get("emitted", 0),
                           tau=m.get("tau", 0.0), alpha=m.get("alpha", []), time_s=m.get("time_s", {}),
                           drafter=m.get("drafter") or "")


def _deadline(context, request_timeout_s: float | None) -> float | None:
    """Seconds this request may take: the client's deadline or the server's default, whichever is shorter."""
    left = context.time_remaining()
    if left is not None and left >= _NO_DEADLINE:
        left = None
    bounds = [t for t in (left, request_timeout_s) if t is not None]
    return max(0.0, min(bounds)) if bounds else None


def _cause(e: BaseException) -> BaseException:
    """The user-facing exception inside a Ray task error (e.g. the verifier's VerifierError)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def local_run(vision, verifier, drafter_address: str | None = None) -> Run:
    """``run`` over in-process engines (what LocalApp wires): VisionEngine.encode, then VerifierEngine.astream."""

    async def run(request: GenerationRequest) -> AsyncIterator[dict]:
        if request.pixel_values is not None:  # on the compute thread, as the verifier's steps (compute_thread.py)
            from specula.runtime.engine.compute_thread import compute_thread

            visual = await compute_thread().acall(vision.encode, request.pixel_values, request.image_grid_thw)
            request = replace(request, visual=visual)
        async for chunk in verifier.astream(request, drafter_address=drafter_address):
            yield chunk

    return run


# ----------------------------------------------------------------------------------------------- auth


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token auth on every method (metadata ``authorization: Bearer <key>``); health checks are open when
    ``open_health``. With no keys every call passes."""

    def __init__(self, keys: frozenset[str], open_health: bool = True) -> None:
        self.keys, self.open_health = keys, open_health

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self.keys:
            return handler
        if self.open_health and details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        return handler if authorized(header, self.keys) else _refuse(handler)


class _Undecodable:
    """Request bytes that are not the method's message; the guarded handler answers INVALID_ARGUMENT."""

    def __init__(self, error: str) -> None:
        self.error = error


class DecodeGuard(grpc.aio.ServerInterceptor):
    """A request to the API whose bytes do not parse as the method's message (truncated, corrupt, bad UTF-8 in a
    string) gets INVALID_ARGUMENT naming the parse error; grpc alone answers UNKNOWN, as for a server fault."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        parse, behaviour = handler.request_deserializer, handler.unary_unary or handler.unary_stream

        def deserialize(raw: bytes):
            try:
                return parse(raw)
            except Exception as e:  # noqa: BLE001 - DecodeError and friends: the client's bytes
                return _Undecodable(f"{type(e).__name__}: {e}")

        async def guarded(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid {details.method.rsplit('/', 1)[-1]} request message: "
                                    f"{request.error}"[:2000])
            return await behaviour(request, context)  # the API's handlers are coroutines (streams: context.write)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return make(guarded, request_deserializer=deserialize, response_serializer=handler.response_serializer)


def _refuse(handler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid token: send metadata 'authorization: Bearer <key>'")

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


# ----------------------------------------------------------------------------------------------- the server


@dataclass
class GrpcServer:
    """A bound public gRPC server (``start`` serves it; ``stop`` / ``close`` end it)."""

    server: grpc.aio.Server
    health: object  # grpc_health.v1._async.HealthServicer
    host: str
    port: int
    tls: bool
    loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once started

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        from grpc_health.v1 import health_pb2

        self.loop = asyncio.get_running_loop()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        log.info("public gRPC API on %s (%s)", self.address, "TLS" if self.tls else "plaintext")

    async def stop(self, grace: float | None = 2.0) -> None:
        """Report NOT_SERVING, then stop; calls still running after ``grace`` seconds are cancelled."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    def close(self, grace: float | None = 2.0) -> None:
        """``stop`` from synchronous code (a replica's ``__del__``): scheduled on the server's loop."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(self.stop(grace))
        else:
            asyncio.run_coroutine_threadsafe(self.stop(grace), loop)


def create_grpc_server(config, servicer: PublicApiServicer) -> GrpcServer:
    """Build and bind ``config.grpc``'s server (the API, health, reflection, auth, TLS); not yet serving.

    Binds ``grpc.host:grpc.port``; with a fixed port, ingress replicas on one node share it (SO_REUSEPORT, grpc's
    default on Linux) and the kernel spreads connections over them; port 0 takes a free port per server. Raises
    RuntimeError naming the address when it cannot bind.
    """
    from grpc_health.v1 import health_pb2_grpc
    from grpc_health.v1._async import HealthServicer
    from grpc_reflection.v1alpha import reflection

    g = config.grpc
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(config.auth.keys(), config.auth.open_health), DecodeGuard()],
        options=[("grpc.max_receive_message_length", g.max_message_bytes),
                 ("grpc.max_send_message_length", g.max_message_bytes)])
    api.pb2_grpc.add_SpeculaServicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if g.reflection:
        reflection.enable_server_reflection([SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    host = f"[{g.host}]" if ":" in g.host and not g.host.startswith("[") else g.host
    where = f"{host}:{g.port}"
    tls = g.tls_cert_file is not None
    try:
        if tls:
            with open(g.tls_key_file, "rb") as k, open(g.tls_cert_file, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = server.add_secure_port(where, creds)
        else:
            port = server.add_insecure_port(where)
    except RuntimeError as e:
        raise RuntimeError(f"gRPC API cannot bind {where}: {e}") from None
    if port == 0:
        raise RuntimeError(f"gRPC API cannot bind {where}")
    return GrpcServer(server, health, g.host, port, tls)


async def start_grpc_server(config, servicer: PublicApiServicer) -> GrpcServer:
    """``create_grpc_server`` and start it in the running event loop."""
    server = create_grpc_server(config, servicer)
    await server.start()
    return server


def serve_in_running_loop(config, servicer: PublicApiServicer) -> GrpcServer:
    """From synchronous code inside a running event loop (a Serve replica's constructor): bind now, so a port
    that cannot be bound fails the caller, and start serving as a task of that loop."""
    loop = asyncio.get_running_loop()  # RuntimeError outside a loop: use start_grpc_server there
    server = create_grpc_server(config, servicer)
    server.loop = loop
    task = loop.create_task(server.start())
    task.add_done_callback(_log_failure)
    return server


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the public gRPC API did not start: %r", task.exception())


# ----------------------------------------------------------------------------------------------- how to call it

EXAMPLE_BODY = '{"prompt": "Say hello.", "max_tokens": 16}'


def grpcurl_example(config) -> str | None:
    """What ``specula serve`` prints: working grpcurl and ``specula chat`` commands for ``config.grpc``."""
    g = config.grpc
    if not g.enabled:
        return None
    if g.port == 0:
        return ("specula: gRPC API on a free port per ingress replica (grpc.port: 0); ask a replica with "
                "serve.get_deployment_handle('Ingress', app_name=...).grpc_address.remote()")
    host = "127.0.0.1" if g.host in ("0.0.0.0", "") else ("::1" if g.host == "::" else g.host)
    where = f"[{host}]:{g.port}" if ":" in host else f"{host}:{g.port}"
    conn = f"-cacert {g.tls_cert_file}" if g.tls_cert_file else "-plaintext"
    chat = f"--ca-cert {g.tls_cert_file} " if g.tls_cert_file else ""
    auth = " -H \"authorization: Bearer $SPECULA_API_KEY\"" if config.auth.keys() else ""
    key_note = "   # with SPECULA_API_KEY set to one of auth's keys" if auth else ""
    return (f"specula: gRPC {SERVICE} on {where} ({'TLS' if g.tls_cert_file else 'plaintext'}); e.g.\n"
            f"  grpcurl {conn}{auth} -d '{EXAMPLE_BODY}' {where} {SERVICE}/Generate{key_note}\n"
            f"  specula chat --address {where} {chat}--image IMAGE.png \"What is in the image?\"")
