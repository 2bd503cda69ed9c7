"""Bad input: >= 1,000 generated malformed requests across HTTP and gRPC each get a client error with a message
(HTTP 4xx with OpenAI's error object; gRPC INVALID_ARGUMENT, or the documented NOT_FOUND / UNAUTHENTICATED /
RESOURCE_EXHAUSTED / UNIMPLEMENTED); the server stays up and answers a valid request as before; its RSS grows
< 50 MiB.

The server is one process, as an ingress replica is: one event loop serving the HTTP routes (``HttpApi``,
http_api.py) and the public gRPC API (``grpc_api.py``), sharing one ``Admission`` and one ``ServeMetrics``, over
the real engines (``LocalApp``: ingress, vision, verifier, ngram drafter on loopback gRPC). HTTP goes through a real
uvicorn server on 127.0.0.1, not Ray Serve: Serve's HTTP proxy is uvicorn too, and the Ingress deployment's
``__call__`` is ``HttpApi.__call__`` on the starlette Request Serve builds from the ASGI scope, which is exactly
what the tiny ASGI app here does; a Ray cluster would add ~30-60 s of start-up on 2 cores and no code on the path
a malformed request takes (none reaches the Ray handles of ``Ingress.run``). Ray's own proxy is tested in
tests/serve/test_openai_http.py.

The requests are built from families (bad JSON, wrong types, max_tokens out of range, bad images: random bytes,
truncated PNGs, decompression bombs, unsupported formats, too many and too large; invalid sampling parameters,
unknown model / drafter, unknown and unsupported fields, missing fields, lone surrogates, oversized bodies and
messages, wrong content types, wrong methods and routes, missing or wrong tokens, bytes that are not the gRPC
message), each drawing variants from a seeded generator; every family checks its own output is really malformed
(a truncated PNG PIL could still decode, or bytes that happen to parse as a valid message, are drawn again).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import http.client
import io
import json
import random
import socket
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from PIL import Image

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp
from specula.runtime.serve.admission import Admission
from specula.runtime.serve.grpc_api import api
from specula.runtime.serve.http_api import HttpApi
from specula.runtime.serve.prometheus import ServeMetrics
from specula.targets import load_target

from reliability_kit import record_figure, scale
from reliability_serving import (EventLoopThread, build_weights, chat_body, make_config, png_b64, rss_mib,
                                 serve_grpc, wait_until, world_body)

pytestmark = [pytest.mark.integration,  # the over-the-limit images make PIL warn before we refuse them
              pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")]
KEY = "rel-key"
MODEL = "tiny-llava"
MAX_TOKENS, MAX_IMAGES = 32, 2
MAX_BODY = 256 * 1024  # limits.max_request_bytes and grpc.max_message_bytes
MAX_IMAGE_BYTES = 64 * 1024
N_HTTP, N_GRPC = scale(600, 6000), scale(420, 4000)
WARM_UP = 120  # requests before the first RSS sample (caches, pools, first-use allocations)


# ----------------------------------------------------------------------------------------------- the server


@dataclass
class Server:
    app: LocalApp
    model_dir: Path
    http_port: int
    grpc_port: int
    metrics: ServeMetrics


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import uvicorn
    from starlette.requests import Request

    from specula.runtime.serve.grpc_api import local_run

    root = build_weights(tmp_path_factory)
    cfg = make_config(root / "target", auth={"api_keys": [KEY]}, http={"served_model_name": MODEL},
                      grpc={"port": 0, "max_message_bytes": MAX_BODY},
                      limits={"max_tokens": MAX_TOKENS, "max_images": MAX_IMAGES, "max_request_bytes": MAX_BODY,
                              "max_image_bytes": MAX_IMAGE_BYTES})
    app = LocalApp.from_config(cfg)
    loop = EventLoopThread()
    admission = Admission(cfg.limits.max_concurrent_requests, cfg.limits.max_queued_requests)
    metrics = ServeMetrics(admission)
    routes = HttpApi(cfg, app.ingress, admission, metrics, local_run(app.vision, app.verifier, app.drafter.address))

    async def asgi(scope, receive, send):  # what Serve does with an ingress deployment's __call__(Request)
        response = await routes(Request(scope, receive))
        await response(scope, receive, send)

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it (else ~40 ms a request:
    sock.bind(("127.0.0.1", 0))                                   # Nagle and delayed ACKs over loopback)
    uv = uvicorn.Server(uvicorn.Config(asgi, lifespan="off", log_level="warning", access_log=False))
    serving = asyncio.run_coroutine_threadsafe(uv.serve(sockets=[sock]), loop.loop)
    _, grpc_server = serve_grpc(loop, cfg, app, admission, metrics)
    try:
        wait_until("uvicorn started", lambda: uv.started or serving.done())
        assert uv.started, serving.result()
        yield Server(app, root / "target", sock.getsockname()[1], grpc_server.port, metrics)
    finally:
        uv.should_exit = True
        serving.result(timeout=30)
        loop.call(grpc_server.stop(grace=1.0))
        loop.close()
        sock.close()
        app.close()


# ----------------------------------------------------------------------------------------------- images


def _png(w: int, h: int, colour=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(buf, format=fmt)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bomb(w: int, h: int) -> bytes:
    """A well-formed PNG header declaring w x h pixels, with a few bytes of pixel data: decoding it would
    allocate w * h * 3 bytes (a decompression bomb); it must be refused from the header alone."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + _chunk(b"IEND", b""))


def _undecodable(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.convert("RGB")
    except Exception:  # noqa: BLE001 - any failure: PIL cannot turn it into pixels
        return True
    return False


GOOD = base64.b64decode(world_body(0)["images"][0])  # a world scene, a real PNG


def bad_image(rng: random.Random) -> tuple[str, bytes]:
    """(what, bytes) of an image the server must refuse."""
    kind = rng.choice(["random", "truncated", "bomb", "over_limit", "gif", "bmp", "tiff", "empty", "too_big",
                       "corrupt_idat", "header_only"])
    if kind == "random":
        data = rng.randbytes(rng.randrange(1, 3000))
    elif kind == "truncated":  # cut inside the pixel data: the header is fine, the pixels are not
        i = GOOD.find(b"IDAT")
        n = int.from_bytes(GOOD[i - 4:i], "big")
        data = GOOD[: rng.randrange(i + 5, i + 4 + n)]
    elif kind == "bomb":
        data = _bomb(rng.randrange(20_000, 2**31 - 1), rng.randrange(20_000, 2**31 - 1))
    elif kind == "over_limit":  # between max_image_pixels and twice it: PIL only warns, our check refuses
        data = _bomb(4097, 4097 + rng.randrange(0, 4000))
    elif kind in ("gif", "bmp", "tiff"):
        data = _encoded(kind.upper())
    elif kind == "empty":
        data = b""
    elif kind == "too_big":  # over max_image_bytes
        data = GOOD + rng.randbytes(MAX_IMAGE_BYTES)
    elif kind == "corrupt_idat":
        b = bytearray(GOOD)
        i = GOOD.find(b"IDAT") + 4
        for _ in range(8):
            b[rng.randrange(i, len(b) - 12)] ^= 0xFF
        data = bytes(b)
    else:
        data = GOOD[:33]  # signature + IHDR, nothing else
    if kind in ("random", "truncated", "corrupt_idat") and not _undecodable(data):
        return bad_image(rng)  # this draw decodes after all: draw again (bombs are not decoded here, by design)
    return kind, data


# ----------------------------------------------------------------------------------------------- HTTP cases


@dataclass
class HttpCase:
    family: str
    method: str
    path: str
    body: bytes | None
    allowed: frozenset[int]
    headers: dict = field(default_factory=dict)
    chunked: bool = False


ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")
E400 = E4xx = frozenset({400})  # every bad request is a 400, as on OpenAI's API


def _base(route: str, rng: random.Random) -> dict:
    """A valid body for ``route`` (small: 1-4 tokens; streamed or not: a refusal comes before the first byte)."""
    n = rng.randrange(1, 5)
    if route == "/generate":
        body = world_body(rng.randrange(6), max_tokens=n) if rng.random() < 0.5 else {"prompt": "Say hi.",
                                                                                   "max_tokens": n}
    elif route == "/v1/chat/completions":
        body = chat_body(world_body(rng.randrange(6), max_tokens=n)) if rng.random() < 0.5 else \
            {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": n}
    else:
        body = {"prompt": "How much is 8 times 0?", "max_tokens": n}
    return {**body, "stream": True} if rng.random() < 0.3 else body


def _http(family, route, body, allowed, **kw) -> HttpCase:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return HttpCase(family, kw.pop("method", "POST"), route, raw, allowed, **kw)


_NOT_INT = ["many", "", [], {}, [1], {"a": 1}, 1.5, "1.5", "one", [[]]]
_NOT_FLOAT = ["hot", "", [], {}, [0.5], {"v": 1}, "warm", [[0.1]]]
_NOT_STR = [5, 1.5, [], {}, ["a"], {"a": "b"}, [[]]]
_NOT_BOOL = ["maybe", [], {}, 5, 1.5, "enabled", [True]]
_FIELDS = {  # route -> field -> wrong-typed values
    "/generate": {"prompt": _NOT_STR, "images": ["x", 5, {}, [5], [None], [[]], [{}]], "max_tokens": _NOT_INT,
                  "temperature": _NOT_FLOAT, "seed": _NOT_INT, "stream": _NOT_BOOL},
    "/v1/chat/completions": {
        "messages": ["hi", 5, {}, [5], ["hi"], [None], [[]]], "max_tokens": _NOT_INT, "temperature": _NOT_FLOAT,
        "top_p": _NOT_FLOAT, "top_k": _NOT_INT, "min_p": _NOT_FLOAT, "seed": _NOT_INT, "n": _NOT_INT,
        "stream": _NOT_BOOL, "stop": [5, [5], {}, [[]], [None]], "model": [5, [], {}, 1.5], "user": _NOT_STR,
        "drafter": _NOT_STR, "stream_options": [5, "x", [], {"include_usage": "maybe"}, {"unknown": 1}],
        "max_completion_tokens": _NOT_INT, "metadata": [5, "x", []]},
    "/v1/completions": {"prompt": [5, 1.5, {}, [1.5], [None], [True, False], [[["x"]]], [{}], ["a", "b"], []],
                        "max_tokens": _NOT_INT, "temperature": _NOT_FLOAT, "top_p": _NOT_FLOAT, "seed": _NOT_INT,
                        "echo": _NOT_BOOL, "stop": [5, [5], {}], "suffix": [5, [], {}]},
}
_TINY_PNG_URL = "data:image/png;base64," + png_b64(Image.new("RGB", (8, 8)))
_BAD_MESSAGES = [  # chat messages lists that are wrong in shape
    [{"role": "user"}], [{"content": "x"}], [{"role": 5, "content": "x"}], [{"role": ["user"], "content": "x"}],
    [{"role": {"r": 1}, "content": "x"}], [{"role": "robot", "content": "x"}], [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}], [{"role": "user", "content": [{}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": [{"type": "audio"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "ultra"}}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "zoom": 2}}]}],
    [{"role": "user", "content": [{"type": ["text"], "text": "a"}]}],
    [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _TINY_PNG_URL}}]}],
    [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}], [{"role": "user", "content": "x", "extra": 1}],
    [{"role": "user", "content": "a <image> b"}], [{"role": "user", "content": [{"type": "text", "text": "<image>"}]}],
    [{"role": "system"}], [[{"role": "user", "content": "x"}]],
]
_UNSUPPORTED = {
    "/v1/chat/completions": [("n", 2), ("n", 5), ("logprobs", True), ("top_logprobs", 3), ("tool_choice", "auto"),
                             ("tools", [{"type": "function", "function": {"name": "f"}}]), ("functions", [{}]),
                             ("function_call", "auto"), ("response_format", {"type": "json_object"}),
                             ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"1": 5}),
                             ("modalities", ["audio"]), ("audio", {}), ("prediction", {}),
                             ("reasoning_effort", "high"), ("verbosity", "low"), ("web_search_options", {}),
                             ("stream_options", {"include_usage": True})],
    "/v1/completions": [("echo", True), ("suffix", "x"), ("best_of", 3), ("n", 2), ("logprobs", 2),
                        ("presence_penalty", 1.0), ("logit_bias", {"5": 1})],
}


def _bad_json(rng: random.Random, text: bytes) -> bytes:
    """A mutation of ``text`` (valid JSON) that is not JSON any more."""
    for _ in range(100):
        op = rng.randrange(7)
        if op == 0:
            out = text[: rng.randrange(0, len(text) - 1)]
        elif op == 1:
            i = rng.randrange(len(text))
            out = text[:i] + bytes([rng.choice(b"{}[]:,\"'\\x")]) + text[i:]
        elif op == 2:
            i = rng.randrange(len(text))
            out = text[:i] + rng.randbytes(rng.randrange(1, 4)) + text[i + 1:]
        elif op == 3:
            out = text + rng.choice([b"x", b"}", b",", b" {}", b"\x00"])
        elif op == 4:
            out = text.replace(b'"', b"'", rng.randrange(1, 4))
        elif op == 5:
            out = b"\xef\xbb\xbf" + text if rng.random() < 0.5 else text.replace(b"e", b"\xff", 1)
        else:
            out = rng.randbytes(rng.randrange(1, 200))
        try:
            json.loads(out)
        except (ValueError, UnicodeDecodeError):
            return out
    return b"{"


def http_case(family: str, rng: random.Random) -> HttpCase:
    route = rng.choice(ROUTES)
    base = _base(route, rng)
    if family == "bad_json":
        fixed = [b"", b" ", b"null", b"[]", b"123", b'"x"', b"true", b"{'prompt': 'x'}", b'{"prompt": "x",}',
                 b'{"prompt": "x"} // c', b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000]
        if rng.random() < 0.3:
            return _http(family, route, rng.choice(fixed), E400)
        return _http(family, route, _bad_json(rng, json.dumps(base).encode()), E400)
    if family == "wrong_type":
        if route == "/v1/chat/completions" and rng.random() < 0.4:
            return _http(family, route, {**base, "messages": rng.choice(_BAD_MESSAGES)}, E4xx)
        name = rng.choice(sorted(_FIELDS[route]))
        return _http(family, route, {**base, name: rng.choice(_FIELDS[route][name])}, E4xx)
    if family == "max_tokens":
        name = "max_completion_tokens" if route == "/v1/chat/completions" and rng.random() < 0.3 else "max_tokens"
        value = rng.choice([0, -1, -(2**31), -(10**20), MAX_TOKENS + 1, 1000, 2**31, 2**63, 10**30, 10**400])
        body = {**base, name: value}
        if name == "max_completion_tokens" and rng.random() < 0.3:
            body = {**base, "max_tokens": 4, "max_completion_tokens": 5}  # they disagree
        return _http(family, route, body, E4xx)
    if family == "sampling":
        nan, inf = float("nan"), float("inf")
        values = {"temperature": [-1, -1e-9, 100.5, inf, -inf, nan], "seed": [-1, 2**64, -(2**70)]}
        if route != "/generate":
            values |= {"top_p": [0, -0.1, 1.0001, 2, nan, inf], "top_k": [-2, -1000], "min_p": [1.0, 1.5, -0.01, nan]}
        else:
            values["seed"].append(2**63)
        name = rng.choice(sorted(values))
        return _http(family, route, {**base, name: rng.choice(values[name])}, E4xx)
    if family == "bad_image":
        return _image_case(rng)
    if family == "unknown_model":
        if rng.random() < 0.25:
            return _http(family, f"/v1/models/{rng.choice(['gpt-17', 'x' * 40, 'TINY-LLAVA', MODEL + '2'])}",
                         None, frozenset({404}), method="GET")
        route = rng.choice(ROUTES[1:])
        base = _base(route, rng)
        if rng.random() < 0.5:
            return _http(family, route, {**base, "model": rng.choice(["gpt-17", "", MODEL.upper(), "m" * 300])},
                         frozenset({404}))
        return _http(family, route, {**base, "drafter": rng.choice(["eagle", "nope", "", "NGRAM", "none"])}, E400)
    if family == "unknown_field":
        key = rng.choice(["temprature", "max_token", "prompts", "image", "top-p", "Stream"]) + \
            ("" if rng.random() < 0.5 else "".join(rng.choice("abcxyz_") for _ in range(rng.randrange(1, 6))))
        return _http(family, route, {**base, key: rng.choice([1, "x", None, [], {}])}, E400)
    if family == "unsupported":
        route = rng.choice(ROUTES[1:])
        name, value = rng.choice(_UNSUPPORTED[route])
        return _http(family, route, {**_base(route, rng), name: value, "stream": False}, E400)
    if family == "missing":
        body = rng.choice([{}, {"max_tokens": 4}, {"stream": False}, {"images": []}, {"temperature": 0.5},
                           {"prompt": ""}, {"messages": []}, {"prompt": []}])
        return _http(family, route, body, E4xx)
    if family == "surrogate":
        s = rng.choice(["\ud800", "a\udfffb", "\udbff", "x\ud83d"])  # lone halves (a valid pair is an emoji)
        where = rng.choice(["text", "stop", "key"])
        body = dict(base)
        if where == "stop" and route != "/generate":
            body["stop"] = [s]
        elif where == "key":
            body[s] = 1
        elif route == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": s}]
        else:
            body["prompt"] = s
        return _http(family, route, body, E400)
    if family == "oversized":
        kind = rng.randrange(3)
        big = {**base, "pad": "x" * (MAX_BODY + rng.randrange(1, 50_000))}
        if kind == 0:
            return _http(family, route, big, frozenset({413}))
        if kind == 1:  # no Content-Length: refused while it streams in
            return _http(family, route, big, frozenset({413}), chunked=True)
        body = {**base, "prompt": "cat " * 5000} if route != "/v1/chat/completions" else \
            {**base, "messages": [{"role": "user", "content": "cat " * 5000}]}  # under the byte limit: too many tokens
        return _http(family, route, body, E400)
    if family == "content_type":
        ctype, body = rng.choice([
            ("application/x-www-form-urlencoded", b"prompt=hi&max_tokens=4"),
            ("multipart/form-data; boundary=xyz", b'--xyz\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n'
                                                  b"hi\r\n--xyz--\r\n"),
            ("text/plain", b"Say hi."), ("application/xml", b"<prompt>hi</prompt>"),
            ("application/octet-stream", rng.randbytes(64)), ("application/msgpack", b"\x81\xa6prompt\xa2hi")])
        return _http(family, route, body, E400, headers={"Content-Type": ctype})
    if family == "method":
        if rng.random() < 0.5:
            return _http(family, route, None, frozenset({405}), method=rng.choice(["GET", "PUT", "DELETE", "PATCH"]))
        path = rng.choice(["/health", "/v1/models", "/metrics"])
        return _http(family, path, b"{}", frozenset({405}), method=rng.choice(["POST", "PUT", "DELETE", "OPTIONS"]))
    if family == "route":
        path = rng.choice(["/v2/chat/completions", "/generate/x", "/v1/chat", "/v1", "/admin", "/v1/embeddings",
                           "/" + "".join(rng.choice("abcdef/") for _ in range(rng.randrange(1, 30)))])
        return _http(family, path, json.dumps(base).encode(), frozenset({404}))
    if family == "auth":
        header = rng.choice([None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer ", "Bearer",
                             f"Token {KEY}"])
        path = rng.choice(ROUTES + ("/v1/models", "/metrics", f"/v1/models/{MODEL}"))
        method = "GET" if path.startswith(("/v1/models", "/metrics")) else "POST"
        headers = {"Authorization": header} if header is not None else {"Authorization": None}
        return _http(family, path, None if method == "GET" else json.dumps(_base(path, rng)
                                                                            if path in ROUTES else {}).encode(),
                     frozenset({401}), method=method, headers=headers)
    raise ValueError(family)


def _image_case(rng: random.Random) -> HttpCase:
    route = rng.choice(ROUTES[:2])
    what = rng.choice(["bytes", "bytes", "bytes", "base64", "url", "count", "markers"])
    if route == "/generate" and what == "url":  # /generate takes base64 only
        what = "base64"
    if what == "count":  # too many images
        images = [base64.b64encode(_png(8, 8)).decode()] * rng.randrange(MAX_IMAGES + 1, MAX_IMAGES + 5)
    elif what == "base64":
        images = [rng.choice(["not base64!", "abc", "====", "data:image/png,abc", "data:image/png;base64,@@",
                              "data:;base64," + "A" * 5, "\u00e9t\u00e9"])]
    elif what == "url":
        images = [rng.choice(["ftp://x/y.png", "file:///etc/passwd", "http://127.0.0.1:9/x.png",
                              "https://example.com/a.png", "relative.png", "javascript:alert(1)", "//x/y.png"])]
    elif what == "markers":
        images = [base64.b64encode(_png(8, 8)).decode()]
    else:
        _, data = bad_image(rng)
        images = [base64.b64encode(data).decode()]
    if route == "/generate":
        prompt = "<image> and <image>?" if what == "markers" else "What is here?"
        return _http("bad_image", route, {"prompt": prompt, "images": images, "max_tokens": 4}, E400)
    if what == "markers":  # chat has no markers: an image part in an assistant message instead
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{images[0]}"}}]
        return _http("bad_image", route, {"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": parts}], "max_tokens": 4},
                     E400)
    urls = [u if what == "url" or u.startswith("data:") else f"data:image/png;base64,{u}" for u in images]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "What?"}]
    return _http("bad_image", route, {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}, E400)


HTTP_FAMILIES = ("bad_json", "wrong_type", "max_tokens", "sampling", "bad_image", "bad_image", "unknown_model",
                 "unknown_field", "unsupported", "missing", "surrogate", "oversized", "content_type", "method",
                 "route", "auth")


class HttpClient:
    """Raw HTTP/1.1 over one keep-alive connection (reopened when the server closes it)."""

    def __init__(self, port: int) -> None:
        self.port, self.conn = port, None

    def send(self, case: HttpCase) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **case.headers}
        headers = {k: v for k, v in headers.items() if v is not None}
        body = case.body
        if case.chunked:
            headers["Transfer-Encoding"] = "chunked"
            data = body
            body = iter([data[i:i + 16384] for i in range(0, len(data), 16384)])
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            try:
                self.conn.request(case.method, case.path, body=body, headers=headers, encode_chunked=case.chunked)
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.close()
                return r.status, data
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check_http(case: HttpCase, status: int, data: bytes) -> str | None:
    """None if refused as it must be, else what is wrong."""
    if status not in case.allowed:
        return f"status {status} (want {sorted(case.allowed)}): {data[:300]!r}"
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without an error object: {data[:300]!r}"
    return None if isinstance(message, str) and message.strip() else f"empty message: {data[:300]!r}"


# ----------------------------------------------------------------------------------------------- gRPC cases


@dataclass
class GrpcCase:
    family: str
    method: str  # "Generate" | "GenerateStream" | an unknown one
    payload: bytes
    allowed: frozenset
    metadata: tuple = (("authorization", f"Bearer {KEY}"),)


INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


def _request(rng: random.Random, **fields) -> bytes:
    base = {"prompt": "What is here?", "max_tokens": rng.randrange(1, 5)}
    if rng.random() < 0.5:
        base["images"] = [GOOD]
    base.update(fields)
    return api.pb2.GenerateRequest(**base).SerializeToString()


def grpc_case(family: str, rng: random.Random) -> GrpcCase:
    method = rng.choice(["Generate", "GenerateStream"])
    nan, inf = float("nan"), float("inf")
    if family == "bytes":  # not a GenerateRequest at all
        for _ in range(100):
            valid = _request(rng, prompt="Say hi.")
            op = rng.randrange(4)
            if op == 0:
                payload = rng.randbytes(rng.randrange(1, 300))
            elif op == 1:
                payload = valid[: rng.randrange(1, len(valid))]
            elif op == 2:
                payload = b"\x0a" + bytes([rng.randrange(2, 20)]) + rng.randbytes(rng.randrange(2, 20))
            else:
                payload = bytes(b ^ (0xFF if rng.random() < 0.05 else 0) for b in valid)
            try:  # keep only bytes that do not parse, or parse to a request with no prompt
                if api.pb2.GenerateRequest.FromString(payload).prompt:
                    continue
            except DecodeError:
                pass
            return GrpcCase(family, method, payload, INVALID)
        return GrpcCase(family, method, b"\xff\xff\xff", INVALID)
    if family == "field":
        name, values = rng.choice([
            ("max_tokens", [0, -1, -(2**31), MAX_TOKENS + 1, 2**31 - 1]),
            ("temperature", [-1.0, nan, inf, -inf, 100.5, -1e-300]), ("top_p", [0.0, -0.5, 1.5, nan, inf]),
            ("top_k", [-1, -(2**31)]), ("min_p", [1.0, -0.1, nan, 2.0]), ("seed", [2**63, 2**64 - 1, 2**63 + 7]),
            ("stop", [[""], ["a"] * 17, ["x" * 257], ["ok", ""]]), ("drafter", ["eagle", "x", "NGRAM"]),
            ("prompt", ["", "<image><image> twice", "cat " * 5000])])
        fields = {name: rng.choice(values)}
        if name == "prompt" and fields["prompt"].startswith("<image>"):
            fields["images"] = [GOOD]
        return GrpcCase(family, method, _request(rng, **fields), INVALID)
    if family == "bad_image":
        if rng.random() < 0.2:
            images = [_png(8, 8)] * rng.randrange(MAX_IMAGES + 1, MAX_IMAGES + 5)
        else:
            images = [bad_image(rng)[1]]
        return GrpcCase(family, method, _request(rng, images=images), INVALID)
    if family == "model":
        return GrpcCase(family, method, _request(rng, model=rng.choice(["gpt-17", MODEL.upper(), "x" * 100])),
                        frozenset({grpc.StatusCode.NOT_FOUND}))
    if family == "oversized":
        fields = {"prompt": "x" * (MAX_BODY + 100)} if rng.random() < 0.5 else {"images": [rng.randbytes(MAX_BODY)]}
        return GrpcCase(family, method, _request(rng, **fields), frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}))
    if family == "auth":
        metadata = rng.choice([(), (("authorization", "Bearer wrong"),), (("authorization", KEY),),
                               (("authorization", f"Basic {KEY}"),), (("x-api-key", KEY),)])
        return GrpcCase(family, method, _request(rng), frozenset({grpc.StatusCode.UNAUTHENTICATED}), metadata)
    if family == "method":
        return GrpcCase(family, rng.choice(["Nope", "generate", "Generate2"]), _request(rng),
                        frozenset({grpc.StatusCode.UNIMPLEMENTED}))
    raise ValueError(family)


GRPC_FAMILIES = ("bytes", "bytes", "field", "field", "field", "bad_image", "bad_image", "model", "auth", "method") * 2 \
    + ("oversized",)  # grpc itself takes ~0.1 s to refuse an oversized message


def send_grpc(channel: grpc.Channel, case: GrpcCase) -> tuple[grpc.StatusCode, str]:
    path = f"/{api.pb2.DESCRIPTOR.services_by_name['Specula'].full_name}/{case.method}"
    try:
        if case.method == "GenerateStream":
            list(channel.unary_stream(path)(case.payload, metadata=case.metadata, timeout=120))
        else:
            channel.unary_unary(path)(case.payload, metadata=case.metadata, timeout=120)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


# ----------------------------------------------------------------------------------------------- the test


def _valid_answers(server: Server, channel: grpc.Channel, client: HttpClient) -> tuple[list[int], list[int]]:
    """A valid greedy request through each door: (HTTP tokens, gRPC tokens)."""
    body = world_body(0, max_tokens=8)
    status, data = client.send(HttpCase("valid", "POST", "/generate", json.dumps(body).encode(), frozenset({200})))
    assert status == 200, data[:500]
    req = api.pb2.GenerateRequest(prompt=body["prompt"], images=[GOOD], max_tokens=8)
    reply = api.pb2_grpc.SpeculaStub(channel).Generate(req, metadata=(("authorization", f"Bearer {KEY}"),),
                                                       timeout=120)
    return json.loads(data)["tokens"], list(reply.tokens)


def test_a_thousand_malformed_requests_are_refused_and_the_server_stays_up(server):
    rng = random.Random(10)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                    options=[("grpc.max_send_message_length", 4 * MAX_BODY),
                                             ("grpc.max_receive_message_length", 4 * MAX_BODY)])
    client = HttpClient(server.http_port)
    body = world_body(0, max_tokens=8)
    want = SpecEngine(load_target(server.model_dir), None).generate(
        [server.app.ingress.prepare(server.app.ingress.parse(body), "ref")])["ref"].tokens  # plain decoding
    assert _valid_answers(server, channel, client) == (want, want)

    cases = [("http", http_case(HTTP_FAMILIES[i % len(HTTP_FAMILIES)], rng)) for i in range(N_HTTP)]
    cases += [("grpc", grpc_case(GRPC_FAMILIES[i % len(GRPC_FAMILIES)], rng)) for i in range(N_GRPC)]
    rng.shuffle(cases)
    failures, statuses, families = [], Counter(), Counter()
    rss = []
    t0 = time.monotonic()
    for n, (door, case) in enumerate(cases):
        if n == WARM_UP:
            gc.collect()
            rss.append(rss_mib())
        if door == "http":
            status, data = client.send(case)
            problem = check_http(case, status, data)
            statuses[f"HTTP {status}"] += 1
        else:
            code, details = send_grpc(channel, case)
            problem = None if code in case.allowed and details.strip() else \
                f"{code.name} (want {sorted(c.name for c in case.allowed)}): {details[:300]!r}"
            statuses[code.name] += 1
        families[f"{door}:{case.family}"] += 1
        if problem is not None:
            failures.append((door, case.family, case.method, case.path if door == "http" else "",
                             (case.body or b"")[:200] if door == "http" else case.payload[:80], problem))
    gc.collect()
    rss.append(rss_mib())
    elapsed = time.monotonic() - t0

    assert not failures, f"{len(failures)} of {len(cases)} not refused as they must be, e.g. {failures[:5]}"
    counted = [line for line in server.metrics.render().splitlines() if line.startswith("specula_requests_total{")]
    assert not [line for line in counted if any(f'code="{c}"' in line for c in ("500", "INTERNAL", "UNKNOWN"))]
    assert _valid_answers(server, channel, client) == (want, want)  # still up, still right
    status, data = client.send(HttpCase("health", "GET", "/health", None, frozenset({200})))
    assert status == 200, data
    growth = rss[1] - rss[0]
    assert growth < 50, f"RSS grew {growth:.1f} MiB over {len(cases) - WARM_UP} malformed requests"
    channel.close()
    client.close()
    n_http = sum(1 for d, _ in cases if d == "http")
    record_figure(
        "test_a_thousand_malformed_requests_are_refused_and_the_server_stays_up",
        f"{len(cases)}/{len(cases)} malformed requests rejected ({n_http} HTTP, {len(cases) - n_http} gRPC; "
        f"{', '.join(f'{k} x{v}' for k, v in sorted(statuses.items()))}), each with a message; "
        f"{len(families)} families; server still answers correctly; RSS {rss[0]:.0f} -> {rss[1]:.0f} MiB "
        f"({growth:+.1f} MiB); {elapsed:.0f} s",
        requests=len(cases), rejected=len(cases), http=n_http, grpc=len(cases) - n_http, statuses=dict(statuses),
        families=len(families), rss_before_mib=round(rss[0], 1), rss_after_mib=round(rss[1], 1),
        rss_growth_mib=round(growth, 1), seconds=round(elapsed, 1))
