"""The verifier's stream to the ingress merges the chunks of steps that come within ``stream_interval_s`` of the
last one it sent (each chunk is one Ray streaming message on the served path): the tokens are the same whatever the
interval, the first token is never held back, and the last chunk carries the metrics."""

from __future__ import annotations

import asyncio

import pytest

from serve_kit import world_requests
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.serve.verifier import VerifierEngine, merge_chunks
from specula.targets import load_target

MAX_TOKENS = 12


def _chunks(model_dir, request, interval: float) -> list[dict]:
    engine = VerifierEngine(load_target(model_dir), None, stream_interval_s=interval, eos_token_ids=[-1])

    async def collect():
        return [c async for c in engine.astream(request)]

    try:
        return asyncio.run(collect())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def request_(processor):
    return world_requests(processor, 1, SamplingParams(max_tokens=MAX_TOKENS), start=1)[0]


def test_no_interval_sends_a_chunk_per_step(model_dir, request_):
    chunks = _chunks(model_dir, request_, 0.0)
    assert [len(c["tokens"]) for c in chunks] == [1] * MAX_TOKENS  # plain decoding: one token per step
    assert chunks[-1]["finished"] and chunks[-1]["metrics"]["emitted"] == MAX_TOKENS


def test_a_long_interval_sends_the_first_token_then_the_rest_in_one_chunk(model_dir, request_):
    every_step = [t for c in _chunks(model_dir, request_, 0.0) for t in c["tokens"]]
    chunks = _chunks(model_dir, request_, 30.0)
    assert len(chunks) == 2
    assert chunks[0]["tokens"] == every_step[:1] and not chunks[0]["finished"]
    assert chunks[1]["tokens"] == every_step[1:] and chunks[1]["finished"]
    assert chunks[1]["finish_reason"] == "length" and chunks[1]["metrics"]["emitted"] == MAX_TOKENS


def test_merge_keeps_the_later_chunks_fields_and_both_tokens():
    a = {"request_id": "r", "tokens": [1, 2], "finished": False, "finish_reason": None}
    b = {"request_id": "r", "tokens": [3], "finished": True, "finish_reason": "eos", "metrics": {"tau": 2.0}}
    assert merge_chunks(a, b) == {**b, "tokens": [1, 2, 3]}


def test_a_whole_answer_gets_its_first_token_and_its_last_chunk_only(model_dir, request_):
    """``streamed=False`` (HTTP without stream and stop strings, unary gRPC Generate): even at one chunk per step,
    the verifier wakes its caller twice, and the answer is the same."""
    from dataclasses import replace

    every_step = [t for c in _chunks(model_dir, request_, 0.0) for t in c["tokens"]]
    chunks = _chunks(model_dir, replace(request_, streamed=False), 0.0)
    assert [c["finished"] for c in chunks] == [False, True]
    assert [t for c in chunks for t in c["tokens"]] == every_step and chunks[0]["tokens"] == every_step[:1]
    assert chunks[1]["metrics"]["emitted"] == MAX_TOKENS


@pytest.mark.parametrize("extra, streamed", [({}, False), ({"stop": ["zzz"]}, True), ({"stream": True}, True)],
                         ids=["whole", "stop-strings", "stream"])
def test_the_http_routes_mark_only_whole_answers_without_stop_strings(model_dir, extra, streamed):
    """What the ingress hands the verifier: a non-streamed answer with no stop string to watch is not streamed
    (the answer over HTTP is the same either way)."""
    import json

    from starlette.requests import Request

    from serve_kit import make_config
    from specula.runtime.serve import LocalApp
    from specula.runtime.serve.admission import Admission
    from specula.runtime.serve.grpc_api import local_run
    from specula.runtime.serve.http_api import HttpApi
    from specula.runtime.serve.ingress import IngressEngine
    from specula.runtime.serve.prometheus import ServeMetrics

    cfg = make_config(model_dir, drafter={"gamma": 0})
    seen = []
    with LocalApp.from_config(cfg) as app:
        inner = local_run(app.vision, app.verifier)

        async def run(request):
            seen.append(request.streamed)
            async for chunk in inner(IngressEngine.upstream(request)):  # stop strings stay at the ingress
                yield chunk

        admission = Admission(2, 2)
        routes = HttpApi(cfg, app.ingress, admission, ServeMetrics(admission), run)
        body = json.dumps({"messages": [{"role": "user", "content": "How much is 8 times 0?"}], "max_tokens": 6,
                           "temperature": 0, **extra}).encode()

        async def call():
            sent = []

            async def receive():
                if not sent:
                    sent.append(1)
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.sleep(3600)

            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
                     "headers": [(b"content-type", b"application/json")], "query_string": b""}
            response = await routes(Request(scope, receive))
            out = []

            async def send(message):
                out.append(message)

            await response(scope, receive, send)
            return response.status_code, b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")

        status, raw = asyncio.run(call())
    assert status == 200 and raw
    assert seen == [streamed]


def test_a_verifier_without_a_remote_drafter_queues_from_the_loop_without_a_worker_thread(model_dir, request_,
                                                                                         monkeypatch):
    """Nothing in ``submit`` can block without a remote drafter to describe, so ``astream`` calls it on the loop: a
    worker thread woken there would fight the prefill it starts for the cores and the GIL. The answer is the same."""
    every_step = [t for c in _chunks(model_dir, request_, 0.0) for t in c["tokens"]]

    async def no_thread(*_a, **_k):
        raise AssertionError("astream handed submit to a worker thread")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    chunks = _chunks(model_dir, request_, 30.0)
    assert [t for c in chunks for t in c["tokens"]] == every_step and chunks[-1]["finished"]
