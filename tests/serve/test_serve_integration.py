"""The application on a real (local, 2-CPU) Ray Serve: four deployments built by build_app, one request through the
HTTP ingress, and the answer must equal plain greedy decoding of the target and the in-process engines' (LocalApp)
token for token, streamed or not, on a model whose answers vary (tests/serve/conftest.py); and a
verifier that fails mid-answer reaches the HTTP client as an error (500, or an error record with no "finished").

Ray 2.60 turns token authentication on for a new local cluster (and writes ~/.ray/auth_token) unless RAY_AUTH_MODE
is set, so the fixture sets RAY_AUTH_MODE=disabled before ray.init (the workers inherit it).
"""

from __future__ import annotations

import json
import sys

import pytest

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp, VerifierEngine
from specula.targets import load_target

from ray_kit import free_port, post, run_app, serve_session
from serve_kit import make_config, world_body

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray's own pydantic use


class _BrokenTarget:
    """A target whose decode steps all fail (prefill works): the verifier fails mid-answer."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, block):
        raise RuntimeError("simulated GPU failure")

    decode_step = verify


class BrokenVerifierEngine(VerifierEngine):
    @classmethod
    def from_config(cls, config):
        from specula.runtime.dataplane import RemoteDrafter
        from specula.runtime.engine.factory import load_target_for

        target = load_target_for(config, "cpu")
        return cls(_BrokenTarget(target), RemoteDrafter(vocab_size=target.info.vocab_size), gamma=config.drafter.gamma)


@pytest.fixture(scope="module")
def served(model_dir):
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = make_config(model_dir, http={"host": "127.0.0.1", "port": port})
    # a second application whose verifier fails after prefill; its classes travel by value
    with serve_session(port, by_value=(sys.modules[__name__],)) as url:
        run_app(build_app(cfg), cfg.name)
        broken = make_config(model_dir, name="broken")
        run_app(build_app(broken, engine_classes={"target_verifier": BrokenVerifierEngine}), "broken",
                route_prefix="/broken")
        yield cfg, url


def test_http_generate_equals_the_in_process_app(served):
    cfg, url = served
    body = world_body(0, max_tokens=16)  # a VQA prompt with one image
    with LocalApp.from_config(cfg) as local:
        want = local.generate(body)
        req = local.ingress.prepare(local.ingress.parse(body), "plain")
    plain = SpecEngine(load_target(cfg.model.path), None).generate([req])["plain"].tokens
    assert len(set(plain)) > 8  # an answer that varies, not one token repeated
    status, raw = post(f"{url}/generate", body)
    assert status == 200, raw[:500]
    got = json.loads(raw)
    assert got["tokens"] == plain == want["tokens"] and got["text"] == want["text"]
    assert got["finish_reason"] == want["finish_reason"]
    assert got["drafter"] == "ok"  # drafts came from the DrafterEnsemble replica over gRPC
    assert got["metrics"]["accepted_tokens"] == want["metrics"]["accepted_tokens"]

    status, raw = post(f"{url}/generate", {**body, "stream": True})
    assert status == 200
    records = [json.loads(line) for line in raw.decode().splitlines()]
    assert records[-1]["finished"] is True
    assert [t for r in records[:-1] for t in r["tokens"]] == want["tokens"]

    status, raw = post(f"{url}/generate", {**body, "max_tokens": 0})
    assert status == 400 and "max_tokens" in json.loads(raw)["error"]["message"]


def test_verifier_failure_reaches_the_client_as_an_error(served):
    _, url = served
    body = world_body(2, max_tokens=8)  # text only
    status, raw = post(f"{url}/broken/generate", body)
    assert status == 500 and "simulated GPU failure" in json.loads(raw)["error"]["message"]
    status, raw = post(f"{url}/broken/generate", {**body, "stream": True})
    records = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and records[0]["tokens"]  # the prefill token went out before the failure ...
    assert "simulated GPU failure" in records[-1]["error"]["message"]  # ... then an error, never "finished"
    assert not any(r.get("finished") for r in records)


def _grpc_address(app_name: str) -> str:
    """host:port of the public gRPC API the app's Ingress replica serves (a free port: serve_kit's config)."""
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=app_name).grpc_address.remote().result(timeout_s=60)


def test_the_ingress_replica_serves_the_grpc_api(served):
    import base64

    import grpc

    from specula.runtime.api_client import ApiError, SpeculaClient

    cfg, url = served
    body = world_body(0, max_tokens=16)
    status, raw = post(f"{url}/generate", body)
    assert status == 200, raw[:500]
    want = json.loads(raw)
    images = [base64.b64decode(s) for s in body["images"]]
    with SpeculaClient(_grpc_address(cfg.name), timeout=120) as client:
        assert client.health() == "SERVING"
        whole = client.generate(body["prompt"], images, max_tokens=16)
        chunks = list(client.stream(body["prompt"], images, max_tokens=16))
        assert whole.tokens == want["tokens"] and whole.text == want["text"] and whole.drafter == "ok"
        assert [t for c in chunks for t in c.tokens] == whole.tokens and "".join(c.text for c in chunks) == whole.text
        with pytest.raises(ApiError) as e:
            client.generate(body["prompt"], images, max_tokens=0)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.message


def test_verifier_failure_reaches_the_grpc_client_as_internal(served):
    import grpc

    from specula.runtime.api_client import ApiError, SpeculaClient

    body = world_body(2, max_tokens=8)  # text only
    with SpeculaClient(_grpc_address("broken"), timeout=120) as client:
        for call in (client.generate, lambda *a, **k: list(client.stream(*a, **k))):
            with pytest.raises(ApiError) as e:
                call(body["prompt"], max_tokens=8)
            assert e.value.code == grpc.StatusCode.INTERNAL and "simulated GPU failure" in e.value.message
