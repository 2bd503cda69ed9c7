"""A Python client for Specula's public gRPC API (protos/specula_api.proto); ``specula chat`` uses it.

    from specula.runtime.api_client import SpeculaClient

    with SpeculaClient("127.0.0.1:50051", token="my-key") as client:     # token: or env SPECULA_API_KEY
        answer = client.generate("What colour is the circle?", images=["scene.png"], max_tokens=32)
        print(answer.text, answer.finish_reason, answer.metrics["tau"])

        for chunk in client.stream("Describe <image> in detail.", images=[png_bytes], temperature=0.7, seed=1):
            print(chunk.text, end="", flush=True)       # the last chunk has finished=True, usage and metrics

        client.models()        # [{"id": "target", "drafter": "ngram", "gamma": 4, ...}]
        client.health()        # "SERVING"

Images may be file paths, encoded bytes (PNG/JPEG/WebP) or PIL images (sent as PNG). Sampling parameters left
out take the server's defaults (greedy, 64 new tokens). A failed call raises ``ApiError`` with the gRPC status
code and the server's message (e.g. ``INVALID_ARGUMENT: max_tokens 5000 > the limit 1024``). Leaving a
``stream`` early cancels the request on the server (its KV cache is freed).

TLS: ``SpeculaClient(address, tls=True, root_certificates=open("ca.pem", "rb").read())`` (system roots when
``root_certificates`` is None).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specula.protos import load

DEFAULT_ADDRESS = "127.0.0.1:50051"
TOKEN_ENV = "SPECULA_API_KEY"
api = load("specula_api")


class ApiError(RuntimeError):
    """A call the server refused or failed: ``code`` is the grpc.StatusCode, ``message`` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class Completion:
    """A whole answer (``Generate``)."""

    id: str
    text: str
    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    usage: dict  # {"prompt_tokens", "completion_tokens"}
    metrics: dict  # {"blocks", "draft_tokens", "accepted_tokens", "emitted", "tau", "alpha", "time_s", "drafter"}
    drafter: str  # "ok" | "off" | "fallback: <why>"
    model: str


@dataclass(frozen=True)
class Chunk:
    """One step of a streamed answer (``GenerateStream``); the last has ``finished`` and the totals."""

    id: str
    tokens: list[int]
    text: str
    accepted_tokens: int  # draft tokens accepted in this step
    tau: float  # tokens per verification so far
    finished: bool = False
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    drafter: str = ""


class SpeculaClient:
    """A channel to one Specula server.

    Args:
        address: host:port of the gRPC API (default 127.0.0.1:50051).
        token: API key sent as ``authorization: Bearer <token>``; default the SPECULA_API_KEY environment variable.
        tls: connect with TLS (``root_certificates``: PEM bytes of the CA; None = the system's).
        timeout: default deadline of each call in seconds (None = none).
        max_message_bytes: largest message sent or received (requests carry images).
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, *, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.address, self.timeout = address, timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = api.pb2_grpc.SpeculaStub(self.channel)

    # ------------------------------------------------------------------------------------------- calls

    def generate(self, prompt: str, images: Iterable = (), *, timeout: float | None = None, **params) -> Completion:
        """The whole answer. ``params``: temperature, top_p, top_k, min_p, seed, max_tokens, stop, drafter, model."""
        try:
            r = self.stub.Generate(request(prompt, images, **params), timeout=self._timeout(timeout),
                                   metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return Completion(r.id, r.text, list(r.tokens), r.finish_reason, _usage(r.usage), _metrics(r.metrics),
                          r.drafter, r.model)

    def stream(self, prompt: str, images: Iterable = (), *, timeout: float | None = None, **params) -> Iterator[Chunk]:
        """The answer as it is accepted, one Chunk per verification step; same ``params`` as ``generate``."""
        call = self.stub.GenerateStream(request(prompt, images, **params), timeout=self._timeout(timeout),
                                        metadata=self._metadata)
        try:
            for c in call:
                yield Chunk(c.id, list(c.tokens), c.text, c.stats.accepted_tokens, c.stats.tau, c.finished,
                            c.finish_reason, _usage(c.usage) if c.finished else {},
                            _metrics(c.metrics) if c.finished else {}, c.drafter)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # no-op after the last chunk; otherwise the server stops generating

    def models(self, timeout: float | None = None) -> list[dict]:
        try:
            r = self.stub.ListModels(api.pb2.ListModelsRequest(), timeout=self._timeout(timeout),
                                     metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return [{"id": m.id, "drafter": m.drafter, "gamma": m.gamma, "max_tokens": m.max_tokens,
                 "max_images": m.max_images} for m in r.models]

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The standard gRPC health check: "SERVING", "NOT_SERVING", ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout),
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpeculaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout


# ----------------------------------------------------------------------------------------------- messages


def request(prompt: str, images: Iterable = (), *, temperature: float | None = None, top_p: float | None = None,
            top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
            max_tokens: int | None = None, stop: Iterable[str] = (), drafter: str = "", model: str = ""):
    """A ``GenerateRequest``; None leaves a parameter to the server's default."""
    if isinstance(stop, str):
        stop = [stop]
    optional = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed,
                "max_tokens": max_tokens}
    return api.pb2.GenerateRequest(prompt=prompt, images=[image_bytes(im) for im in images], stop=list(stop),
                                   drafter=drafter, model=model,
                                   **{k: v for k, v in optional.items() if v is not None})


def image_bytes(image) -> bytes:
    """Encoded image bytes from a path, bytes, or a PIL image (encoded as PNG)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        return Path(image).read_bytes()
    if hasattr(image, "save"):  # PIL.Image.Image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be a path, bytes or a PIL image, got {type(image).__name__}")


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}


def _metrics(m) -> dict:
    return {"blocks": m.blocks, "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
            "emitted": m.emitted, "tau": m.tau, "alpha": list(m.alpha), "time_s": dict(m.time_s), "drafter": m.drafter}


def _error(e: grpc.RpcError) -> ApiError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return ApiError(code, details or "")


# ----------------------------------------------------------------------------------------------- specula chat


def chat_cli(args, out=None, err=None) -> int:
    """``specula chat``: one question to a running server; the answer on stdout. Exit 1 on an API error."""
    import sys

    out, err = out or sys.stdout, err or sys.stderr
    roots = Path(args.ca_cert).read_bytes() if args.ca_cert else None
    params = {"temperature": args.temperature, "max_tokens": args.max_tokens, "seed": args.seed}
    try:
        with SpeculaClient(args.address, args.token, tls=args.tls or roots is not None, root_certificates=roots,
                           timeout=args.timeout) as client:
            if args.stream:
                last = None
                for chunk in client.stream(args.question, args.image, **params):
                    out.write(chunk.text)
                    out.flush()
                    last = chunk
                out.write("\n")
                summary = (last.finish_reason, last.usage, last.metrics) if last is not None else None
            else:
                answer = client.generate(args.question, args.image, **params)
                out.write(answer.text + "\n")
                summary = (answer.finish_reason, answer.usage, answer.metrics)
    except ApiError as e:
        err.write(f"specula chat: {e}\n")
        return 1
    if args.stats and summary is not None:
        reason, usage, metrics = summary
        err.write(f"[{reason}; {usage.get('completion_tokens', 0)} tokens; tau {metrics.get('tau', 0.0):.2f}]\n")
    return 0
