"""The OpenAI-compatible HTTP API on a real (local, 2-CPU) Ray Serve, called by the official ``openai`` client, by
raw HTTP (urllib: the SSE bytes themselves) and by ``curl``, loopback only.

One application for the whole module (its start is most of the time): the default shape (ngram drafter over gRPC)
with bearer auth, ``image_dir`` set, a small ``max_request_bytes``, ``max_concurrent_requests: 1`` /
``max_queued_requests: 0`` and ``request_timeout_s: 6``. Its verifier engine is the real one, except that a
request asking for >= 60 tokens (``SLOW``) takes 1 s per verification: such an answer surely outlives the
deadline (>= 12 verifications of at most gamma + 1 = 5 tokens) and a running one surely holds the only slot, with
no timing assumption; every other request runs at full speed, one at a time (the tests are sequential).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from specula.runtime.serve import VerifierEngine

from ray_kit import free_port, run_app, serve_session
from serve_kit import make_config, record_figure, world_body

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 6.0
SLOW = 60  # max_tokens from which a request is slow


class _SlowTarget:
    """The real target; a verification (or plain decode step) that includes a slow request sleeps 1 s first."""

    def __init__(self, inner, slow: set) -> None:
        self.inner, self.slow = inner, slow

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode_step(self, ids):
        self._wait(ids)
        return self.inner.decode_step(ids)

    def verify(self, block):
        self._wait(block.request_ids)
        return self.inner.verify(block)

    def _wait(self, ids) -> None:
        if self.slow.intersection(ids):
            time.sleep(1.0)


class SlowWhenAskedVerifierEngine(VerifierEngine):
    def __init__(self, target, *args, **kwargs) -> None:
        self.slow: set[str] = set()
        super().__init__(_SlowTarget(target, self.slow), *args, **kwargs)

    def submit(self, request, sink, drafter_address=None) -> None:
        if request.params.max_tokens >= SLOW:
            self.slow.add(request.request_id)
        super().submit(request, sink, drafter_address)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from specula.world import generate

    root = tmp_path_factory.mktemp("served_images")
    generate("vqa", "eval", 0).images[0].save(root / "vqa0.png")
    return root


@pytest.fixture(scope="module")
def served_cfg(model_dir, image_dir):
    http = {"host": "127.0.0.1", "port": free_port(), "served_model_name": "tiny-llava"}
    return make_config(model_dir, http=http, auth={"api_keys": [KEY]},
                       limits={"max_tokens": 64, "max_images": 4, "image_dir": str(image_dir),
                               "max_request_bytes": 1_000_000, "max_concurrent_requests": 1,
                               "max_queued_requests": 0, "request_timeout_s": TIMEOUT_S})


@pytest.fixture(scope="module")
def served(served_cfg):
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    cfg = served_cfg
    with serve_session(cfg.http.port, by_value=(sys.modules[__name__],)) as url:
        run_app(build_app(cfg, engine_classes={"target_verifier": SlowWhenAskedVerifierEngine}), cfg.name)
        yield url


def test_serve_lets_every_request_reach_the_admission_queue():
    """Serve's own per-replica cap must not hold requests back before the ingress can refuse them with 503."""
    pytest.importorskip("ray")
    from specula.runtime.config import load_config
    from specula.runtime.serve.builder import build_app

    app = build_app(load_config({"limits": {"max_concurrent_requests": 100, "max_queued_requests": 50}}))
    assert app._bound_deployment.name == "Ingress"  # noqa: SLF001 (Serve has no public accessor)
    assert app._bound_deployment.max_ongoing_requests >= 150 + 16  # noqa: SLF001


# ----------------------------------------------------------------------------------------------- helpers


def _call(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60):
    """(status, headers, body bytes) of one raw HTTP call; ``body`` a dict (JSON) or bytes; the API key unless
    ``headers`` are given."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = AUTH if headers is None else headers
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err  # OpenAI's error object
    return err


def _events(raw: bytes) -> list[str]:
    """The data lines of an SSE body; every event is exactly 'data: ...' + a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def _png_data_url(i: int = 0) -> str:
    return "data:image/png;base64," + world_body(i)["images"][0]


def _chat(max_tokens=12, **extra) -> dict:
    return {"model": "tiny-llava", "max_tokens": max_tokens, "temperature": 0.8, "seed": 11, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url()}},
                                     {"type": "text", "text": "What shape is it?"}]}], **extra}


def _metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _client(url: str, key: str = KEY, **kw):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120, **kw)


# ----------------------------------------------------------------------------------------------- the main app


def test_openai_client_chat_models_and_completions(served):
    openai = pytest.importorskip("openai")
    client = _client(served)
    assert [m.id for m in client.models.list().data] == ["tiny-llava"]
    assert client.models.retrieve("tiny-llava").owned_by == "specula"

    body = _chat(16)
    messages, kw = body.pop("messages"), {k: body[k] for k in ("model", "max_tokens", "temperature", "seed")}
    whole = client.chat.completions.create(messages=messages, **kw)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 16 and whole.usage.total_tokens == whole.usage.prompt_tokens + \
        whole.usage.completion_tokens
    spec = whole.model_extra["specula"]
    assert spec["drafter"] == "ok" and spec["metrics"]["tau"] >= 1 and spec["finish_reason"] in ("eos", "length")

    # the same request through POST /generate (same seed): the same answer
    status, _, raw = _call("POST", f"{served}/generate", {**world_body(0, 16), "prompt": "<image>What shape is it?",
                                                          "temperature": 0.8, "seed": 11})
    assert status == 200 and json.loads(raw)["text"] == text

    # streamed: the same text, usage in a last chunk
    stream = client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                            **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    # extensions: top_k / min_p / the deployment's own drafter; another drafter is refused, not ignored
    ext = client.chat.completions.create(messages=messages, extra_body={"top_k": 40, "min_p": 0.05,
                                                                        "drafter": "ngram"}, **kw)
    assert ext.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=messages, extra_body={"drafter": "eagle"}, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == "drafter"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(messages=messages, **{**kw, "model": "gpt-4o"})
    assert e.value.body["code"] == "model_not_found"

    comp = client.completions.create(model="tiny-llava", prompt="How much is 8 times 0?", max_tokens=8,
                                     temperature=0.9, seed=2)
    assert comp.object == "text_completion" and comp.usage.completion_tokens <= 8
    parts = list(client.completions.create(model="tiny-llava", prompt="How much is 8 times 0?", max_tokens=8,
                                           temperature=0.9, seed=2, stream=True))
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text


def test_raw_sse_bytes_and_done(served):
    status, headers, raw = _call("POST", f"{served}/v1/chat/completions",
                                 _chat(8, stream=True, stream_options={"include_usage": True}))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(raw)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    finals = [o for o in objs if o["choices"] and o["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and "tau" in finals[0]["specula"]["metrics"]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] <= 8
    status, _, whole = _call("POST", f"{served}/v1/chat/completions", _chat(8))
    content = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
    assert content == json.loads(whole)["choices"][0]["message"]["content"]


def test_curl(served):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.7,
                       "seed": 1})
    key = ["-H", f"Authorization: Bearer {KEY}"]
    out = subprocess.run([curl, "-sS", "--fail-with-body", f"{served}/v1/chat/completions", *key, "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["object"] == "chat.completion"
    out = subprocess.run([curl, "-sS", "-N", f"{served}/v1/chat/completions", *key, "-H",
                          "Content-Type: application/json", "-d", json.dumps({**json.loads(body), "stream": True})],
                         capture_output=True, timeout=120)
    assert out.returncode == 0 and _events(out.stdout)[-1] == "[DONE]"
    out = subprocess.run([curl, "-sS", f"{served}/v1/models", *key], capture_output=True, timeout=60)
    assert json.loads(out.stdout)["data"][0]["id"] == "tiny-llava"


def test_the_printed_examples_work(served, served_cfg):
    """What `specula serve` prints (openai_api.http_examples) runs as printed: curl, curl -N, the openai client."""
    from specula.runtime.serve.openai_api import http_examples

    if shutil.which("curl") is None or shutil.which("base64") is None:
        pytest.skip("no curl/base64 on this machine")
    lines = [x.strip() for x in http_examples(served_cfg).splitlines() if x.startswith("  ") and "(" != x.strip()[0]]
    assert [x.split()[0] for x in lines] == ["curl", "curl", "python"]
    env = {**os.environ, "SPECULA_API_KEY": KEY}
    bindir = os.path.dirname(sys.executable)  # `python` in the example: this venv's, which has openai
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    outs = [subprocess.run(["bash", "-c", x], capture_output=True, timeout=120, env=env) for x in lines]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-500:] for o in outs]
    assert json.loads(outs[0].stdout)["choices"][0]["message"]["role"] == "assistant"
    assert _events(outs[1].stdout)[-1] == "[DONE]"
    assert outs[2].stdout.endswith(b"\n")  # the client printed the answer


_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "temprature": 1}, 400, "temprature"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "n": 3}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "logprobs": True}, 400, "logprobs"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "stream": "yes"}, 400, "stream"),  # strict, as max_tokens is
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("POST", "/generate", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "max_tokens": 65}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "model": "nope"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400,
     "messages[0].content[0].image_url.url"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}, 400, "messages[0].content[0].image_url.url"),
    ("POST", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("POST", "/generate", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("POST", "/v1/models", {}, 405, None),
    ("GET", "/v2/nothing", None, 404, None),
    ("GET", "/v1/models/gpt-4o", None, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": _MSG, "pad": "x" * 1_100_000}, 413, None),
])
def test_bad_requests_get_their_status_in_openai_shape(served, method, path, body, status, param):
    got, headers, raw = _call(method, served + path, body)
    err = _error(raw)
    assert got == status, err
    assert err["param"] == param and err["message"]
    if status == 405:
        assert headers["Allow"] in ("GET", "POST") and headers["Allow"] in err["message"]


def test_server_keeps_serving_and_images_come_from_image_dir(served, image_dir):
    for url in ((image_dir / "vqa0.png").as_uri(), "vqa0.png", _png_data_url()):
        body = _chat(6)
        body["messages"][0]["content"][0]["image_url"]["url"] = url
        status, _, raw = _call("POST", f"{served}/v1/chat/completions", body)
        assert status == 200, raw
    contents = set()
    for url in ("vqa0.png", _png_data_url()):  # the same picture from a file and inline: the same answer
        body = _chat(6)
        body["messages"][0]["content"][0]["image_url"]["url"] = url
        contents.add(json.loads(_call("POST", f"{served}/v1/chat/completions", body)[2])["choices"][0]["message"]
                     ["content"])
    assert len(contents) == 1


def test_metrics_count_requests_and_speculation(served):
    status, headers, before = _call("GET", f"{served}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    status, _, raw = _call("POST", f"{served}/v1/chat/completions", _chat(12, temperature=0))  # greedy: the
    assert status == 200                                                        # random model repeats, ngram drafts
    m = json.loads(raw)["specula"]["metrics"]
    _call("POST", f"{served}/v1/chat/completions", {"messages": _MSG, "n": 2})
    after = _call("GET", f"{served}/metrics")[2].decode()
    before = before.decode()

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("specula_requests_total", route="/v1/chat/completions", code="200") == 1
    assert delta("specula_requests_total", route="/v1/chat/completions", code="400") == 1
    assert delta("specula_spec_draft_tokens_total") == m["draft_tokens"] > 0
    assert delta("specula_spec_accepted_tokens_total") == m["accepted_tokens"]
    assert delta("specula_spec_verifications_total") == m["blocks"]
    assert delta("specula_spec_drafted_per_position_total", position="1") == m["drafted_at"][0]
    assert delta("specula_generation_tokens_total") == m["emitted"]
    assert delta("specula_time_seconds_total", phase="verify") > 0
    assert _metric(after, "specula_spec_tau") >= 1
    assert _metric(after, "specula_requests_running") == 0
    status, _, raw = _call("GET", f"{served}/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"


# ----------------------------------------------------------------------------------------------- auth, limits


def _live(app: str = "specula") -> list[str]:
    from ray import serve

    return serve.get_deployment_handle("TargetVerifier", app_name=app).live_requests.remote().result()


def _wait(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


ONE_TOKEN = {"messages": _MSG, "max_tokens": 1, "temperature": 0.7, "seed": 1}


@pytest.mark.parametrize("method, path, body, open_status", [
    ("POST", "/v1/chat/completions", ONE_TOKEN, 200),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/v1/models/tiny-llava", None, 200),
    ("POST", "/generate", {"prompt": "hi", "max_tokens": 1}, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/nothing", None, 404),
])
def test_auth_on_every_route(served, method, path, body, open_status, request):
    url = f"{served}{path}"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, h, raw = _call(method, url, body, headers)
        assert status == 401 and _error(raw)["code"] == "invalid_api_key" and h["WWW-Authenticate"] == "Bearer"
    status, _, raw = _call(method, url, body, AUTH)
    assert status == open_status, raw
    record_figure(request.node.name, f"HTTP {method} {path}: no / wrong / unprefixed token -> 3/3 HTTP 401 "
                  f"invalid_api_key; valid token -> {status}", refused=3, total=3)


def test_health_is_open_and_the_openai_client_sends_its_key(served):
    openai = pytest.importorskip("openai")
    assert _call("GET", f"{served}/health", headers={})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        _client(served, "wrong").models.list()
    client = _client(served, KEY)
    assert client.chat.completions.create(model="tiny-llava", **ONE_TOKEN).usage.completion_tokens == 1


def test_backpressure_then_disconnect_frees_the_request(served):
    url = f"{served}/v1/chat/completions"
    req = urllib.request.Request(url, json.dumps({**ONE_TOKEN, "max_tokens": SLOW, "stream": True}).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    before = _call("GET", f"{served}/metrics")[2].decode()
    r = urllib.request.urlopen(req, timeout=60)
    try:
        assert r.readline().startswith(b"data: ")  # the stream runs: it holds the only slot
        assert len(_live()) == 1
        with pytest.raises(Exception, match="the verifier runs in the TargetVerifier deployment"):
            from ray import serve  # this app's verifier has its own deployment: the ingress holds no KV cache

            serve.get_deployment_handle("Ingress", app_name="specula").live_requests.remote().result()
        status, headers, raw = _call("POST", url, ONE_TOKEN)
        assert status == 503 and headers["Retry-After"] == "1"
        assert _error(raw)["code"] == "server_overloaded"
        running = _call("GET", f"{served}/metrics")[2].decode()
        assert _metric(running, "specula_requests_running") == 1
    finally:
        r.close()  # the client goes away mid-stream
    _wait("the verifier freed the disconnected request", lambda: _live() == [])
    _wait("the slot came back", lambda: _call("POST", url, ONE_TOKEN)[0] == 200)
    after = _call("GET", f"{served}/metrics")[2].decode()
    assert _metric(after, "specula_generations_total", reason="closed_early") - \
        _metric(before, "specula_generations_total", reason="closed_early") == 1
    assert _metric(after, "specula_stream_errors_total") == _metric(before, "specula_stream_errors_total")  # not
    assert _metric(after, "specula_requests_total", code="503") >= 1                     # freed by the deadline
    record_figure("test_backpressure_then_disconnect_frees_the_request",
                  "HTTP backpressure: one slot held by a stream -> the next request HTTP 503 server_overloaded "
                  "(Retry-After 1) at once; the client left mid-stream -> the verifier freed it and the slot served "
                  "again (1 generation counted closed_early)", status=503)


def test_timeout_is_408_and_cancels_the_generation(served):
    url = f"{served}/v1/chat/completions"
    status, _, raw = _call("POST", url, {**ONE_TOKEN, "max_tokens": SLOW})  # >= 12 s of verifications
    assert status == 408 and _error(raw)["code"] == "request_timeout"
    _wait("the verifier freed the timed-out request", lambda: _live() == [])
    # streamed: the answer started (200), so the deadline ends it with an error event and no [DONE]
    status, _, raw = _call("POST", url, {**ONE_TOKEN, "max_tokens": SLOW, "stream": True})
    events = _events(raw)
    assert status == 200 and events[-1] != "[DONE]"
    metrics = _call("GET", f"{served}/metrics")[2].decode()
    assert _metric(metrics, "specula_stream_errors_total", route="/v1/chat/completions", code="408") == 1
    assert json.loads(events[-1])["error"]["code"] == "request_timeout"
    assert json.loads(events[0])["object"] == "chat.completion.chunk"
    t0 = time.monotonic()
    _wait("the verifier freed the timed-out stream", lambda: _live() == [])
    freed_s = time.monotonic() - t0
    assert _call("POST", url, ONE_TOKEN)[0] == 200  # and the replica still serves
    record_figure("test_timeout_is_408_and_cancels_the_generation",
                  f"HTTP deadline: unary -> 408 request_timeout, streamed -> an error event request_timeout and no "
                  f"[DONE] after {len(events) - 1} chunk(s); both generations cancelled (freed "
                  f"{freed_s:.2f} s after the stream ended); the replica still serves", status=408,
                  chunks_before_error=len(events) - 1)
