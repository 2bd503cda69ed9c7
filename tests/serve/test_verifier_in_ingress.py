"""``deployments.target_verifier.in_ingress`` (the default on one CPU node) on a real, local Ray Serve: the Ingress
replica runs the verifier's engine and drafts (drafter.colocate) itself; here its images come from a VisionEncoder
replica (the fully folded default, images encoded by the verifier's own tower, is served by test_serve_fits and
answers as plain decoding in test_one_machine_default). Its answers equal the in-process app's and plain
decoding's token for token, over HTTP (whole and streamed) and the public gRPC API; a client that leaves
mid-stream frees the request's KV cache in that replica; a verifier that fails reaches the client as an error,
never a short answer."""

from __future__ import annotations

import json
import sys

import pytest

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp
from specula.targets import load_target

import test_openai_http
import test_serve_integration
from ray_kit import free_port, post, run_app, serve_session, stream_records, wait_for
from serve_kit import make_config, world_body
from test_openai_http import SLOW, SlowWhenAskedVerifierEngine
from test_serve_integration import BrokenVerifierEngine

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]  # Ray's own pydantic use

ONE_MACHINE = {"colocate": True, "adaptive": True, "begin_after": 2}


def _config(model_dir, port: int, name: str = "specula"):
    cfg = make_config(model_dir, drafter=ONE_MACHINE, name=name, http={"host": "127.0.0.1", "port": port})
    raw = cfg.model_dump(mode="json")
    raw["deployments"]["target_verifier"]["in_ingress"] = True
    from specula.runtime.config import load_config

    return load_config(raw)


@pytest.fixture(scope="module")
def served(model_dir):
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = _config(model_dir, port)
    by_value = (sys.modules[test_openai_http.__name__], sys.modules[test_serve_integration.__name__])
    with serve_session(port, by_value=by_value) as url:
        run_app(build_app(cfg, engine_classes={"target_verifier": SlowWhenAskedVerifierEngine}), cfg.name)
        broken = _config(model_dir, port, name="broken")
        run_app(build_app(broken, engine_classes={"target_verifier": BrokenVerifierEngine}), "broken",
                route_prefix="/broken")
        yield cfg, url


def _ingress(app: str = "specula"):
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=app)


def test_one_ingress_deployment_answers_as_the_in_process_app_and_plain_decoding(served):
    import base64

    from ray import serve

    from specula.runtime.api_client import SpeculaClient

    cfg, url = served
    assert set(serve.status().applications[cfg.name].deployments) == {"Ingress", "VisionEncoder"}
    drafted = 0
    with LocalApp.from_config(cfg) as local:
        target = load_target(cfg.model.path)
        for sample in (0, 1, 2):  # two image questions and a text one
            body = world_body(sample, max_tokens=16)
            want = local.generate(body)
            req = local.ingress.prepare(local.ingress.parse(body), "plain")
            plain = SpecEngine(target, None).generate([req])["plain"].tokens
            status, raw = post(f"{url}/generate", body, timeout=120)
            assert status == 200, raw[:500]
            got = json.loads(raw)
            assert got["tokens"] == plain == want["tokens"] and got["text"] == want["text"]
            assert got["drafter"] == "ok" and got["metrics"]["drafter"] == cfg.drafter.default_name
            drafted += got["metrics"]["draft_tokens"]
            records = list(stream_records(f"{url}/generate", body, timeout=120))
            assert records[-1]["finished"] is True
            assert [t for r in records[:-1] for t in r["tokens"]] == plain
    assert drafted > 0  # the colocated drafter drafted in the ingress replica
    body = world_body(0, max_tokens=16)
    address = _ingress().grpc_address.remote().result(timeout_s=60)
    with SpeculaClient(address, timeout=120) as client:
        whole = client.generate(body["prompt"], [base64.b64decode(s) for s in body["images"]], max_tokens=16)
    assert whole.tokens == json.loads(post(f"{url}/generate", body, timeout=120)[1])["tokens"]


def test_a_client_leaving_mid_stream_frees_its_request_in_the_ingress(served):
    _, url = served
    body = world_body(2, max_tokens=SLOW)  # 1 s per verification here: it would run a minute
    records = stream_records(f"{url}/generate", body, timeout=60)
    first = next(records)
    assert first["tokens"]
    wait_for("the request live in the ingress's verifier", lambda: len(_ingress().live_requests.remote().result())
             == 1, 30)
    records.close()  # the client goes away
    wait_for("the ingress freed the request's KV cache", lambda: _ingress().live_requests.remote().result() == [], 30)
    status, raw = post(f"{url}/generate", world_body(2, max_tokens=4), timeout=60)
    assert status == 200 and len(json.loads(raw)["tokens"]) == 4  # and it serves on


def test_a_failing_verifier_in_the_ingress_reaches_the_client_as_an_error(served):
    _, url = served
    body = world_body(2, max_tokens=8)
    status, raw = post(f"{url}/broken/generate", body, timeout=60)
    assert status == 500 and "simulated GPU failure" in json.loads(raw)["error"]["message"]
    status, raw = post(f"{url}/broken/generate", {**body, "stream": True}, timeout=60)
    records = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and records[0]["tokens"]  # the prefill's token went out, then an error, never "finished"
    assert "simulated GPU failure" in records[-1]["error"]["message"]
    assert not any(r.get("finished") for r in records)


def test_an_ingress_whose_verifier_loop_died_reports_unhealthy(model_dir):
    """Serve's health check of the Ingress replica covers the verifier inside it: a dead loop fails it (Serve then
    replaces the replica), a live one passes."""
    from specula.runtime.serve.deployments import Ingress
    from specula.runtime.serve.verifier import VerifierError

    cfg = make_config(model_dir, drafter={"gamma": 0}, grpc={"enabled": False}).model_dump(mode="json")
    cfg["deployments"]["target_verifier"]["in_ingress"] = True
    ingress = Ingress.func_or_class(cfg, None, None)
    try:
        ingress.check_health()
        ingress.hosted.engine._fatal = RuntimeError("simulated loop crash")
        with pytest.raises(VerifierError, match="simulated loop crash"):
            ingress.check_health()
    finally:
        ingress.hosted.engine._fatal = None
        ingress.hosted.engine.close()
