"""``http.direct``: the Ingress replica's own HTTP door (runtime/serve/direct_http.py).

The door's mechanics on a real uvicorn server over a recording handler (no Ray): the application's route prefix,
the body handed over intact, a client that leaves a non-streamed request cancels the handler, a taken port is
waited for and then refused with the config fields to change. Then on a real, local Ray Serve: an application
whose Ingress replica listens on its own port (Serve's proxy on another) answers there as through the proxy, token
for token; a client that leaves, streamed or not, frees its request's KV cache in that replica. Who decides
``http.direct`` (``specula serve``) and what the config refuses.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import sys
import threading
import time

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse

from specula.runtime.serve.direct_http import DirectHttp, bind
from specula.runtime.serve.http_api import _path

import test_openai_http
from ray_kit import free_port, post, run_app, serve_session, stream_records, wait_for
from serve_kit import make_config, world_body
from test_openai_http import SLOW, SlowWhenAskedVerifierEngine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")


class _Door:
    """A DirectHttp over a recording handler, on its own event loop thread."""

    def __init__(self, route_prefix: str = "/") -> None:
        self.seen: list[tuple[str, str, int]] = []  # (method, path as HttpApi routes it, body bytes)
        self.cancelled = threading.Event()
        self.started = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        ready = threading.Event()

        async def handler(request: Request):
            body = b""
            async for part in request.stream():
                body += part
            self.seen.append((request.method, _path(request), len(body)))
            if _path(request) == "/slow":
                self.started.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            return JSONResponse({"path": _path(request), "bytes": len(body)})

        async def start():
            self.door = DirectHttp(handler, "127.0.0.1", self.port, route_prefix)
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        assert ready.wait(10)

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.door.close)
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(self.door.task, 10), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def door():
    d = _Door("/api")
    yield d
    d.close()


def test_the_door_serves_the_route_prefix_and_hands_the_body_over_intact(door):
    big = bytes(range(256)) * 2000  # 512 KB: many receive messages
    assert door.call("POST", "/api/v1/chat/completions", big) == (200, {"path": "/v1/chat/completions",
                                                                        "bytes": len(big)})
    assert door.call("GET", "/api") == (200, {"path": "/", "bytes": 0})
    status, body = door.call("GET", "/apix/health")  # outside the prefix: never reaches the handler
    assert status == 404 and body["error"]["code"] == "not_found"
    assert door.seen == [("POST", "/v1/chat/completions", len(big)), ("GET", "/", 0)]


def test_a_client_that_leaves_a_non_streamed_request_cancels_its_handler(door):
    with socket.create_connection(("127.0.0.1", door.port), timeout=10) as s:
        s.sendall(b"POST /api/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert door.started.wait(10)
    assert door.cancelled.wait(10)  # the generation behind it would stop here, its KV cache freed
    assert door.call("GET", "/api/health")[0] == 200  # and the door serves on


def test_a_taken_port_is_waited_for_then_refused_naming_the_fields():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(OSError, match=r"http\.port \(specula serve --port\).*http\.direct: false"):
            bind("127.0.0.1", port, wait_s=0.6)
        assert time.monotonic() - t0 >= 0.5
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(0.5, holder.close).start()  # a predecessor replica that lets go while we wait
    sock = bind("127.0.0.1", port, wait_s=10)
    assert sock.getsockname()[1] == port
    sock.close()


def test_the_door_leaves_the_process_signals_to_their_owner():
    """On a loop in the main thread (a replica run with Serve's user code there) uvicorn would take SIGINT and
    SIGTERM for as long as it serves; the replica's process (Ray) must keep them."""
    import signal

    before = signal.getsignal(signal.SIGTERM)

    async def serve_a_moment():
        door = DirectHttp(lambda request: JSONResponse({}), "127.0.0.1", free_port())
        await asyncio.sleep(0.3)
        during = signal.getsignal(signal.SIGTERM)
        door.close()
        await asyncio.wait_for(door.task, 10)
        return during

    assert asyncio.run(serve_a_moment()) is before


def test_specula_serve_decides_direct_for_one_ingress_on_this_machine():
    from specula.runtime.config import load_config
    from specula.runtime.serve.launch import direct_http

    assert direct_http(load_config({}), local=True).http.direct is True
    assert direct_http(load_config({}), local=False).http.direct is False  # joining a cluster: Serve's proxy
    two = load_config({"deployments": {"ingress": {"num_replicas": 2}}})
    assert direct_http(two, local=True).http.direct is False
    assert direct_http(load_config({"http": {"direct": False}}), local=True).http.direct is False
    with pytest.raises(ValueError, match="http.direct: true needs one Ingress replica"):
        load_config({"http": {"direct": True}, "deployments": {"ingress": {"num_replicas": 2}}})


# ----------------------------------------------------------------------------------------------- on Ray Serve


@pytest.fixture(scope="module")
def served(model_dir):
    pytest.importorskip("ray")
    from specula.runtime.config import load_config
    from specula.runtime.serve.builder import build_app

    proxy_port, direct_port = free_port(), free_port()
    raw = make_config(model_dir, drafter={"gamma": 0}, http={"host": "127.0.0.1", "port": direct_port,
                                                                "direct": True}).model_dump(mode="json")
    raw["deployments"]["target_verifier"]["in_ingress"] = True
    cfg = load_config(raw)
    with serve_session(proxy_port, by_value=(sys.modules[test_openai_http.__name__],)) as proxy:
        run_app(build_app(cfg, engine_classes={"target_verifier": SlowWhenAskedVerifierEngine}), cfg.name)
        yield proxy, f"http://127.0.0.1:{direct_port}"


def _live() -> list[str]:
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name="specula").live_requests.remote().result(timeout_s=30)


@pytest.mark.integration
def test_the_ingress_replica_answers_on_its_own_port_as_through_the_proxy(served):
    openai = pytest.importorskip("openai")
    proxy, direct = served
    for sample in (0, 2):  # an image question, a text one
        body = world_body(sample, max_tokens=12)
        a, b = post(f"{direct}/generate", body, timeout=120), post(f"{proxy}/generate", body, timeout=120)
        assert a[0] == b[0] == 200 and json.loads(a[1])["tokens"] == json.loads(b[1])["tokens"]
        streamed = list(stream_records(f"{direct}/generate", body, timeout=120))
        assert [t for r in streamed[:-1] for t in r["tokens"]] == json.loads(b[1])["tokens"]
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=6,
                                            messages=[{"role": "user", "content": "How much is 8 times 0?"}])
    assert answer.usage.completion_tokens >= 1 and answer.choices[0].message.content is not None
    status, raw = post(f"{direct}/v1/chat/completions", {"messages": []}, timeout=60)
    assert status == 400 and json.loads(raw)["error"]["message"]  # errors are the routes' own


@pytest.mark.integration
def test_a_client_leaving_the_direct_door_frees_its_request(served):
    _, direct = served
    host, port = direct.removeprefix("http://").split(":")
    body = json.dumps(world_body(2, max_tokens=SLOW)).encode()  # 1 s per verification: it would run a minute
    with socket.create_connection((host, int(port)), timeout=30) as s:  # not streamed: no byte before the end
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for("the request live in the ingress", lambda: len(_live()) == 1, 30)
    wait_for("the ingress freed the request's KV cache", lambda: _live() == [], 30)
    records = stream_records(f"{direct}/generate", world_body(2, max_tokens=SLOW), timeout=60)
    assert next(records)["tokens"]
    wait_for("the streamed request live", lambda: len(_live()) == 1, 30)
    records.close()  # streamed: the client goes away mid-stream
    wait_for("the ingress freed the streamed request", lambda: _live() == [], 30)
    status, raw = post(f"{direct}/generate", world_body(2, max_tokens=4), timeout=60)
    assert status == 200 and len(json.loads(raw)["tokens"]) == 4
