"""The public gRPC API on a real grpc.aio server (127.0.0.1, a free port) over the real engines (IngressEngine,
VisionEngine, VerifierEngine with a DrafterService on loopback) and a tiny random LLaVA; real grpcio clients.

The verifier's target is wrapped in a gate (``_GatedTarget``): closed, every verification step waits, so a request
can be held mid-answer deterministically (deadline, cancellation, backpressure) and the steps it takes after the
gate opens can be counted, which shows it was cancelled rather than left to finish.
"""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
import threading
import time

import grpc
import pytest

from specula.runtime.api_client import ApiError, SpeculaClient, chat_cli, request as make_request
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve.admission import Admission
from specula.runtime.serve.grpc_api import PublicApiServicer, api, local_run, start_grpc_server
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.verifier import VerifierEngine
from specula.runtime.serve.vision import VisionEngine
from specula.targets import load_target

from serve_kit import make_config, record_figure, world_body

pytestmark = pytest.mark.integration
KEY = "test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


class _GatedTarget:
    """A target whose verification steps wait for ``gate`` (set = open) and are counted."""

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.steps = inner, threading.Event(), 0
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, block):
        self.gate.wait()
        self.steps += 1
        return self.inner.verify(block)

    def decode_step(self, ids):
        self.gate.wait()
        self.steps += 1
        return self.inner.decode_step(ids)


class _Loop:
    """An event loop in a thread: the server's (as a Serve replica's user-code loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Stack:
    """The module's engines, plus servers made over them."""

    def __init__(self, model_dir) -> None:
        from specula.runtime.dataplane import DrafterServer, RemoteDrafter

        self.cfg = make_config(model_dir, limits={"max_images": 2, "max_tokens": 64},
                               grpc={"port": 0}, auth={"api_keys": [KEY]})
        self.ingress = IngressEngine.from_config(self.cfg)
        self.vision = VisionEngine.from_config(self.cfg)
        self.target = _GatedTarget(load_target(model_dir))
        self.reference = load_target(model_dir)  # plain decoding, outside the verifier's thread
        self.verifier = VerifierEngine(self.target, RemoteDrafter(vocab_size=self.target.info.vocab_size),
                                       gamma=self.cfg.drafter.gamma)
        self.drafter = DrafterServer.from_config(self.cfg)
        self.drafter.start()
        self.loop = _Loop()
        self.servers = []

    def serve(self, cfg=None, admission: Admission | None = None, metrics=None):
        """A started server over the shared engines: (servicer, server)."""
        cfg = cfg or self.cfg
        admission = admission or Admission(cfg.limits.max_concurrent_requests, cfg.limits.max_queued_requests)
        run = local_run(self.vision, self.verifier, self.drafter.address)
        servicer = PublicApiServicer.from_config(cfg, self.ingress, run, admission, metrics)
        server = self.loop.call(start_grpc_server(cfg, servicer))
        self.servers.append(server)
        return servicer, server

    def config(self, **sections):
        raw = self.cfg.model_dump(mode="json")
        for k, v in sections.items():
            raw[k] = {**raw[k], **v}
        from specula.runtime.config import load_config

        return load_config(raw)

    def wait_idle(self, servicer=None, bound_s: float = 60.0) -> None:
        """Until no handler runs and the verifier holds no request (no KV cache, no row, no id)."""
        end = time.monotonic() + bound_s
        while time.monotonic() < end:
            if ((servicer is None or servicer.active == 0) and not self.verifier.engine.rows
                    and not self.target.live_ids and not self.verifier._ids):  # noqa: SLF001
                return
            time.sleep(0.02)
        raise AssertionError(f"still busy: rows {list(self.verifier.engine.rows)}, live {self.target.live_ids}")

    def close(self) -> None:
        self.target.gate.set()
        for s in self.servers:
            self.loop.call(s.stop(grace=0.5))
        self.loop.close()
        self.verifier.close()
        self.drafter.stop()


@pytest.fixture(scope="module")
def stack(model_dir):
    s = Stack(model_dir)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def main(stack):
    servicer, server = stack.serve()
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        yield servicer, server, client


@pytest.fixture
def gate(stack):
    """Close the gate for a test; always reopened (and the verifier drained) afterwards."""
    stack.target.gate.clear()
    try:
        yield stack.target
    finally:
        stack.target.gate.set()
        stack.wait_idle()


def _images(i: int) -> tuple[str, list[bytes]]:
    body = world_body(i)
    return body["prompt"], [base64.b64decode(s) for s in body["images"]]


def _plain(stack, prompt, images, max_tokens):
    """Plain target decoding (no drafter) of the same prepared request: the lossless reference."""
    body = {"prompt": prompt, "images": [base64.b64encode(b).decode() for b in images], "max_tokens": max_tokens}
    req = stack.ingress.prepare(stack.ingress.parse(body), "ref")
    return SpecEngine(stack.reference, None, gamma=0).generate([req])["ref"]


# ----------------------------------------------------------------------------------------------- answers


def test_unary_generate_asks_the_verifier_for_the_whole_answer_only(stack):
    """Unary Generate without stop strings needs no chunk between the first and the last (GenerationRequest
    .streamed); a stream, or stop strings to watch, keep them."""
    seen = []
    inner = local_run(stack.vision, stack.verifier, stack.drafter.address)

    async def run(request):
        seen.append(request.streamed)
        async for chunk in inner(request):
            yield chunk

    cfg = stack.cfg
    servicer = PublicApiServicer.from_config(cfg, stack.ingress, run, Admission(2, 2), None)
    server = stack.loop.call(start_grpc_server(cfg, servicer))
    stack.servers.append(server)
    prompt, images = _images(2)
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        whole = client.generate(prompt, images, max_tokens=8, temperature=0.0)
        chunks = list(client.stream(prompt, images, max_tokens=8, temperature=0.0))
        client.generate(prompt, images, max_tokens=8, temperature=0.0, stop=["zzz"])
    assert seen == [False, True, True]
    assert whole.tokens == [t for c in chunks for t in c.tokens]  # the same answer
    stack.wait_idle(servicer)


@pytest.mark.parametrize("sample", [0, 2])  # one image; text only
def test_greedy_unary_and_stream_equal_plain_decoding(stack, main, sample):
    _, _, client = main
    prompt, images = _images(sample)
    ref = _plain(stack, prompt, images, 24)
    whole = client.generate(prompt, images, max_tokens=24, temperature=0.0)
    chunks = list(client.stream(prompt, images, max_tokens=24))
    assert whole.tokens == ref.tokens and whole.finish_reason == ref.finish_reason
    assert whole.text == stack.ingress.tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert "".join(c.text for c in chunks) == whole.text
    last = chunks[-1]
    assert last.finished and not any(c.finished for c in chunks[:-1])
    assert last.finish_reason == whole.finish_reason and last.usage == whole.usage
    assert whole.usage["completion_tokens"] == len(ref.tokens) and whole.usage["prompt_tokens"] > 0
    assert whole.drafter == "ok" and whole.model == stack.cfg.model.path.rsplit("/", 1)[-1]
    # per-chunk stats add up to the verifier's own metrics
    m = last.metrics
    assert sum(c.accepted_tokens for c in chunks) == m["accepted_tokens"]
    assert last.tau == pytest.approx(m["tau"], abs=1e-3) and m["emitted"] == len(whole.tokens)
    assert chunks[0].accepted_tokens == 0 and chunks[0].tau == 0.0


def test_sampled_unary_and_stream_equal_for_a_seed(stack, main):
    _, _, client = main
    prompt, images = _images(1)
    params = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=7, max_tokens=24)
    whole = client.generate(prompt, images, **params)
    chunks = list(client.stream(prompt, images, **params))
    assert whole.text and whole.text == stack.ingress.tokenizer.decode(whole.tokens, skip_special_tokens=True)
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert "".join(c.text for c in chunks) == whole.text
    assert client.generate(prompt, images, **params).tokens == whole.tokens
    other = client.generate(prompt, images, **{**params, "seed": 8})
    assert other.tokens != whole.tokens  # the seed is honoured (24 sampled tokens of a random model)


def test_stop_strings_cut_the_text_and_free_the_request(stack, main):
    servicer, _, client = main
    prompt, images = _images(0)
    sampled = dict(temperature=1.0, seed=3, max_tokens=40)  # the random model's greedy answer is special tokens
    full = client.generate(prompt, images, **sampled)
    assert len(full.text) > 12, full.text
    stop = full.text[8:12]
    want = full.text[: full.text.find(stop)]
    whole = client.generate(prompt, images, **sampled, stop=[stop, "\x00never"])
    chunks = list(client.stream(prompt, images, **sampled, stop=[stop]))
    assert whole.text == want and whole.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"
    assert whole.tokens == full.tokens[: len(whole.tokens)]
    stack.wait_idle(servicer)


def test_list_models_and_health(stack, main):
    _, server, client = main
    [model] = client.models()
    assert model == {"id": stack.cfg.model.path.rsplit("/", 1)[-1], "drafter": "ngram", "gamma": 4,
                     "max_tokens": 64, "max_images": 2}
    with SpeculaClient(f"127.0.0.1:{server.port}") as anonymous:  # health is open (auth.open_health)
        assert anonymous.health() == "SERVING"
        assert anonymous.health("specula.api.v1.Specula") == "SERVING"


def _reflect(port: int, metadata=AUTH) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        [resp] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                metadata=metadata, timeout=30))
        return sorted(s.name for s in resp.list_services_response.service)


def test_reflection_lists_the_services(main):
    _, server, _ = main
    assert _reflect(server.port) == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                     "specula.api.v1.Specula"]


def test_the_printed_grpcurl_example_is_a_valid_call(stack, main):
    from google.protobuf import json_format

    from specula.runtime.serve.grpc_api import EXAMPLE_BODY, grpcurl_example

    _, server, _ = main
    text = grpcurl_example(stack.config(grpc={"port": 50051}))  # what `specula serve` prints
    assert f"-d '{EXAMPLE_BODY}' 127.0.0.1:50051 specula.api.v1.Specula/Generate" in text
    assert "authorization: Bearer $SPECULA_API_KEY" in text  # auth is on in this config
    req = json_format.Parse(EXAMPLE_BODY, api.pb2.GenerateRequest())  # grpcurl's JSON -> the request
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        reply = api.pb2_grpc.SpeculaStub(ch).Generate(req, metadata=AUTH, timeout=60)
    assert 1 <= len(reply.tokens) <= 16 and reply.finish_reason in ("eos", "length")


def test_replicas_on_one_node_share_a_fixed_port(stack):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = stack.config(grpc={"port": port})
    (_, a), (_, b) = stack.serve(cfg), stack.serve(cfg)  # as two ingress replicas would (SO_REUSEPORT)
    assert a.port == b.port == port
    for _ in range(4):  # new channels each time: the kernel spreads connections over both servers
        with SpeculaClient(f"127.0.0.1:{port}", KEY) as client:
            assert client.models()[0]["gamma"] == 4


# ----------------------------------------------------------------------------------------------- refusals


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(images=[b"not an image at all"]), "images[0]"),
    (dict(images=[_png(8, 8)] * 3), "images"),
    (dict(prompt="<image> and <image>", images=[_png(8, 8)]), "'<image>' markers"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=65), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=1.0), "min_p"),
    (dict(seed=2**63), "seed"),
    (dict(stop=[""]), "stop[0]"),
    (dict(drafter="eagle"), "drafter"),
])
def test_bad_input_is_invalid_argument_naming_the_field(main, kwargs, field):
    _, _, client = main
    args = {"prompt": "What is here?", "images": [], "max_tokens": 4, **kwargs}
    for call in (client.generate, lambda *a, **k: list(client.stream(*a, **k))):
        with pytest.raises(ApiError) as e:
            call(args["prompt"], args["images"], **{k: v for k, v in args.items() if k not in ("prompt", "images")})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert field in e.value.message, e.value.message
    assert client.generate("What is here?", max_tokens=2).usage["completion_tokens"] >= 1  # still serving


def test_unknown_model_is_not_found(main):
    _, _, client = main
    with pytest.raises(ApiError) as e:
        client.generate("hi", max_tokens=2, model="gpt-17")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "model" in e.value.message


def test_oversized_message_is_refused(stack):
    cfg = stack.config(grpc={"max_message_bytes": 4096})
    _, server = stack.serve(cfg)
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        with pytest.raises(ApiError) as e:
            client.generate("hi", [b"\x00" * 8192], max_tokens=2)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate("hi", max_tokens=2).tokens  # still serving


@pytest.mark.parametrize("token", [None, "wrong-key"])
def test_every_method_needs_a_valid_token(main, token, request):
    _, server, _ = main
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = api.pb2_grpc.SpeculaStub(ch)
        req = make_request("hi", max_tokens=2)
        calls = [lambda: stub.Generate(req, metadata=metadata, timeout=30),
                 lambda: list(stub.GenerateStream(req, metadata=metadata, timeout=30)),
                 lambda: stub.ListModels(api.pb2.ListModelsRequest(), metadata=metadata, timeout=30),
                 lambda: _reflect(server.port, metadata)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in e.value.details()
    record_figure(request.node.name, f"gRPC with {'no' if token is None else 'a wrong'} token: {len(calls)}/"
                  f"{len(calls)} methods (Generate, GenerateStream, ListModels, reflection) UNAUTHENTICATED",
                  refused=len(calls), total=len(calls))


def test_health_needs_a_token_when_not_open(stack):
    _, server = stack.serve(stack.config(auth={"open_health": False}))
    with SpeculaClient(f"127.0.0.1:{server.port}", token="") as anonymous:
        with pytest.raises(ApiError) as e:
            anonymous.health()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        assert client.health() == "SERVING"


def test_statuses_are_counted_in_the_replica_metrics(stack):
    from specula.runtime.serve.prometheus import ServeMetrics

    metrics = ServeMetrics()
    _, server = stack.serve(metrics=metrics)
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        client.generate("hi", max_tokens=2)
        list(client.stream("hi", max_tokens=2))
        client.models()
        with pytest.raises(ApiError):
            client.generate("", max_tokens=2)
    lines = [line for line in metrics.render().splitlines() if line.startswith("specula_requests_total{")]
    for route, code in [("grpc:Generate", "OK"), ("grpc:GenerateStream", "OK"), ("grpc:ListModels", "OK"),
                        ("grpc:Generate", "INVALID_ARGUMENT")]:
        assert any(f'route="{route}"' in line and f'code="{code}"' in line and line.endswith(" 1")
                   for line in lines), lines


# ----------------------------------------------------------------------------------------------- load, time, leaving


def _wait(predicate, what: str, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never: {what}")
        time.sleep(0.02)


def test_backpressure_is_resource_exhausted(stack, gate):
    servicer, server = stack.serve(admission=Admission(max_concurrent=1, max_queued=0))
    prompt, images = _images(2)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = api.pb2_grpc.SpeculaStub(ch)
        held = stub.GenerateStream(make_request(prompt, images, max_tokens=32), metadata=AUTH, timeout=120)
        next(held)  # prefilled; its first verification waits at the gate: the one slot is taken
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(make_request("hi", max_tokens=2), metadata=AUTH, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in e.value.details()
        held.cancel()
        _wait(lambda: servicer.active == 0, "the held request's handler ended")
    gate.gate.set()
    stack.wait_idle(servicer)
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY) as client:
        assert client.generate("hi", max_tokens=2).tokens  # the slot came back
    record_figure("test_backpressure_is_resource_exhausted",
                  "gRPC backpressure: max_concurrent 1, queue 0, one stream held -> the next Generate "
                  "RESOURCE_EXHAUSTED at once; the held call cancelled -> the slot served again",
                  code="RESOURCE_EXHAUSTED")


def _held_then_released(stack, servicer, gate) -> int:
    """After the handler ended, open the gate: the verification steps the request still took."""
    _wait(lambda: servicer.active == 0, "the handler ended")
    before = gate.steps
    gate.gate.set()
    stack.wait_idle(servicer)
    return gate.steps - before


@pytest.mark.parametrize("where", ["client", "server"])
def test_deadline_exceeded_frees_the_request(stack, main, gate, where, request):
    if where == "client":
        servicer, server, _ = main
        timeout = 1.0
    else:  # limits.request_timeout_s, no client deadline
        servicer, server = stack.serve(stack.config(limits={"request_timeout_s": 1.0}))
        timeout = None
    prompt, images = _images(0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = api.pb2_grpc.SpeculaStub(ch)
        future = stub.Generate.future(make_request(prompt, images, max_tokens=64), metadata=AUTH, timeout=timeout)
        with pytest.raises(grpc.RpcError) as e:
            future.result()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    steps = _held_then_released(stack, servicer, gate)
    assert steps <= 1  # cancelled, not left to run 64 tokens
    record_figure(request.node.name, f"gRPC {where} deadline 1 s -> DEADLINE_EXCEEDED; the request was cancelled "
                  f"({steps} verification step(s) after the deadline, of 64 tokens asked)", steps_after=steps)


def test_cancel_mid_stream_frees_the_request(stack, main, gate):
    servicer, server, _ = main
    prompt, images = _images(0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = api.pb2_grpc.SpeculaStub(ch)
        call = stub.GenerateStream(make_request(prompt, images, max_tokens=64), metadata=AUTH, timeout=120)
        first = next(call)
        assert first.tokens and not first.finished
        assert stack.target.live_ids  # its KV cache is held
        call.cancel()
        assert call.code() == grpc.StatusCode.CANCELLED
    assert _held_then_released(stack, servicer, gate) <= 1


# ----------------------------------------------------------------------------------------------- chat, TLS


def _chat_args(*argv):
    from specula.cli import build_parser

    return build_parser().parse_args(["chat", *argv])


def test_chat_prints_the_answer(stack, main, tmp_path):
    _, server, client = main
    prompt, images = _images(0)
    path = tmp_path / "scene.png"
    path.write_bytes(images[0])
    want = client.generate(prompt, images, max_tokens=16).text
    for mode in ("--stream", "--no-stream"):
        out, err = io.StringIO(), io.StringIO()
        args = _chat_args("--image", str(path), prompt, "--address", f"127.0.0.1:{server.port}", "--token", KEY,
                          "--max-tokens", "16", "--temperature", "0", "--stats", mode)
        assert chat_cli(args, out, err) == 0, err.getvalue()
        assert out.getvalue() == want + "\n"
        assert err.getvalue().startswith("[") and "tau" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    args = _chat_args(prompt, "--address", f"127.0.0.1:{server.port}", "--token", "nope")
    assert chat_cli(args, out, err) == 1 and "UNAUTHENTICATED" in err.getvalue()


def test_chat_command_in_a_subprocess(main, tmp_path):
    _, server, client = main
    prompt, images = _images(0)
    path = tmp_path / "scene.png"
    path.write_bytes(images[0])
    want = client.generate(prompt, images, max_tokens=8).text
    done = subprocess.run([sys.executable, "-m", "specula.cli", "chat", "--image", str(path), prompt,
                           "--address", f"127.0.0.1:{server.port}", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=120,
                          env={"SPECULA_API_KEY": KEY, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


def _self_signed(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem", cert_pem


def test_tls(stack, tmp_path):
    cert, key, pem = _self_signed(tmp_path)
    _, server = stack.serve(stack.config(grpc={"tls_cert_file": str(cert), "tls_key_file": str(key)}))
    assert server.tls
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY, tls=True, root_certificates=pem) as client:
        assert client.models()[0]["drafter"] == "ngram"
        assert client.generate("hi", max_tokens=2).tokens
    with SpeculaClient(f"127.0.0.1:{server.port}", KEY, timeout=5) as plaintext:
        with pytest.raises(ApiError) as e:
            plaintext.models()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

