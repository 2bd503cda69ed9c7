"""Drafter choice per request, end to end: one deployment serving three drafters (config ``drafter.alternatives``:
the default ngram chain, a sampled random chain, a random tree) behind LocalApp (ingress, VisionEngine,
VerifierEngine, a DrafterServer running a MultiDrafter on loopback gRPC), through POST /generate, the OpenAI
translation and the public gRPC API (a real grpc.aio server, a real grpcio client).

Requests choosing different drafters, sent together so they share the verifier's batch, all give plain greedy
decoding's tokens, and their metrics name the drafter that drafted (as the drafter replica reported it); the tree
drafter's requests show tree blocks (more nodes than gamma). An unknown name is a 400 / INVALID_ARGUMENT naming the
field and listing the choices, and the server keeps serving; a verifier that sends an unknown name anyway gets no
drafts from the replica and decodes alone, output unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import torch

from specula.runtime.api_client import ApiError, SpeculaClient
from specula.runtime.config import ConfigError, load_config
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp, RequestError
from specula.runtime.serve.grpc_api import PublicApiServicer, api, local_run, start_grpc_server
from specula.targets import load_target

from serve_kit import make_config, world_body

pytestmark = pytest.mark.integration
GAMMA = 3
CHOICES = ("ngram", "rchain", "rtree")  # the default first
SAMPLES = (0, 2)  # one image; text only


@pytest.fixture(scope="module")
def cfg(model_dir):
    # deadlines far above any step on a busy machine: a fallback here would be a slow machine, not the choice
    return make_config(model_dir, drafter={
        "gamma": GAMMA, "propose_timeout_s": 120.0, "connect_timeout_s": 60.0,
        "alternatives": {"rchain": {"kind": "random", "options": {"seed": 1, "peaked": 2.0}},
                         "rtree": {"kind": "random", "options": {"seed": 2, "structure": "tree"}}}})


@pytest.fixture(scope="module")
def app(cfg):
    with LocalApp.from_config(cfg) as a:
        yield a


@pytest.fixture(scope="module")
def reference(model_dir, app):
    """Plain greedy decoding of each sample (the target reads the pixels itself; no drafter, no gRPC)."""
    eng = SpecEngine(load_target(model_dir), None)
    out = {}
    for i in SAMPLES:
        req = app.ingress.prepare(app.ingress.parse(world_body(i, 16)), f"ref{i}")
        out[i] = eng.generate([req])[req.request_id].tokens
    return out


def _check_drafted_by(result: dict, name: str) -> None:
    m = result["metrics"]
    assert result["drafter"] == "ok" and m["drafter"] == name, (result["drafter"], m)
    if name != "ngram":  # the random drafters draft every block (ngram only where it finds a match)
        assert m["draft_tokens"] > 0
    if name == "rtree":  # tree blocks: more nodes per block than gamma (a chain never has)
        assert m["draft_tokens"] > GAMMA * m["blocks"]
    else:
        assert m["draft_tokens"] <= GAMMA * m["blocks"]


# ----------------------------------------------------------------------------------------------- config


def test_config_names_the_drafters_and_refuses_bad_names(cfg, app):
    assert cfg.drafter.names() == CHOICES and app.ingress.drafters == CHOICES
    assert app.drafter.info.kind == "multi" and tuple(app.drafter.info.drafters) == CHOICES
    assert app.openai_api.models()["data"][0]["drafters"] == list(CHOICES)
    base = cfg.model_dump(mode="json")
    for alternatives, match in [({"ngram": {"kind": "random"}}, "default drafter's name"),
                                ({"bad name": {"kind": "random"}}, "drafter.alternatives"),
                                ({"x": {"kind": "random", "option": {}}}, "alternatives.x.option: unknown key")]:
        with pytest.raises(ConfigError, match=match):
            load_config({**base, "drafter": {**base["drafter"], "alternatives": alternatives}})
    old = load_config({**base, "drafter": {"kind": "ngram", "gamma": 4}})  # a config of before: one drafter
    assert old.drafter.names() == ("ngram",) and old.drafter.alternatives == {}


# ----------------------------------------------------------------------------------------------- HTTP shapes


def test_requests_choosing_different_drafters_in_one_batch_equal_plain(app, reference):
    jobs = [(i, name) for i in SAMPLES for name in (*CHOICES, None)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # at once: they share the verifier's batch
        futures = [pool.submit(app.generate, {**world_body(i, 16), **({"drafter": n} if n else {})})
                   for i, n in jobs]
        results = [f.result(timeout=600) for f in futures]
    for (i, name), got in zip(jobs, results):
        assert got["tokens"] == reference[i], (i, name)
        _check_drafted_by(got, name or "ngram")  # no choice: the default


def test_openai_routes_carry_the_choice(app, reference):
    body = world_body(0, 16)
    parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{body['images'][0]}"}},
             {"type": "text", "text": body["prompt"].replace("<image>", "")}]
    chat = app.openai("chat", {"messages": [{"role": "user", "content": parts}], "max_tokens": 16,
                               "temperature": 0, "drafter": "rtree"})
    _check_drafted_by(chat["specula"], "rtree")
    whole = app.generate({**body, "drafter": "rtree"})
    assert chat["choices"][0]["message"]["content"] == whole["text"] and whole["tokens"] == reference[0]
    chunks = app.openai("completions", {"prompt": "a red circle", "max_tokens": 8, "temperature": 0,
                                        "drafter": "rchain", "stream": True})
    _check_drafted_by(chunks[-1]["specula"], "rchain")


@pytest.mark.parametrize("kind, body", [
    ("generate", {"prompt": "hi", "max_tokens": 4, "drafter": "eagle"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "drafter": "eagle"}),
    ("completions", {"prompt": "hi", "max_tokens": 4, "drafter": ""}),
])
def test_an_unknown_drafter_is_400_naming_the_field_and_the_choices(app, kind, body):
    with pytest.raises(RequestError, match=r"drafter: .* is not served here; choose one of "
                                           r"\['ngram', 'rchain', 'rtree'\]") as e:
        app.generate(body) if kind == "generate" else app.openai(kind, body)
    assert (e.value.status, e.value.param) == (400, "drafter")
    assert app.generate({"prompt": "hi", "max_tokens": 4, "drafter": "rchain"})["drafter"] == "ok"  # still serving


def test_a_name_the_replica_does_not_serve_decodes_alone_unchanged(app, reference):
    """A verifier that skipped the ingress's check: the replica is not asked, the output does not change."""
    req = app.ingress.prepare(app.ingress.parse(world_body(2, 16)), "unchecked")
    chunks = list(app.run(replace(req, drafter="eagle")))
    assert [t for c in chunks for t in c["tokens"]] == reference[2]
    assert chunks[-1]["drafter"].startswith("fallback") and "'eagle' is not served" in chunks[-1]["drafter"]
    assert chunks[-1]["metrics"]["drafter"] == "" and chunks[-1]["metrics"]["draft_tokens"] == 0


# ----------------------------------------------------------------------------------------------- gRPC


@pytest.fixture(scope="module")
def grpc_client(cfg, app):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    servicer = PublicApiServicer.from_config(cfg, app.ingress, local_run(app.vision, app.verifier,
                                                                         app.drafter.address),
                                             _admission(cfg))
    server = call(start_grpc_server(cfg, servicer))
    try:
        with SpeculaClient(f"127.0.0.1:{server.port}") as client:
            yield client
    finally:
        call(server.stop(grace=0.5))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _admission(cfg):
    from specula.runtime.serve.admission import Admission

    return Admission(cfg.limits.max_concurrent_requests, cfg.limits.max_queued_requests)


def test_grpc_requests_choosing_different_drafters_equal_plain(grpc_client, reference):
    body = world_body(0, 16)
    prompt, images = body["prompt"], [base64.b64decode(s) for s in body["images"]]
    with ThreadPoolExecutor(len(CHOICES)) as pool:
        futures = {n: pool.submit(grpc_client.generate, prompt, images, max_tokens=16, drafter=n) for n in CHOICES}
        results = {n: f.result(timeout=600) for n, f in futures.items()}
    for name, r in results.items():
        assert r.tokens == reference[0], name
        _check_drafted_by({"drafter": r.drafter, "metrics": r.metrics}, name)
    chunks = list(grpc_client.stream(prompt, images, max_tokens=16, drafter="rtree"))
    assert [t for c in chunks for t in c.tokens] == reference[0] and chunks[-1].metrics["drafter"] == "rtree"
    [model] = grpc_client.stub.ListModels(api.pb2.ListModelsRequest()).models
    assert model.drafter == "ngram" and list(model.drafters) == list(CHOICES)


def test_grpc_unknown_drafter_is_invalid_argument(grpc_client):
    with pytest.raises(ApiError) as e:
        grpc_client.generate("hi", max_tokens=4, drafter="eagle")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "drafter: 'eagle' is not served here; choose one of ['ngram', 'rchain', 'rtree']" in e.value.message
    assert grpc_client.generate("hi", max_tokens=4).metrics["drafter"] == "ngram"  # still serving; the default


# ----------------------------------------------------------------------------------------------- overlap


def _pass_through_eagle(model_dir, target):
    """An eagle head that passes h_i through (as in test_overlap.py): it drafts the target's last choice, so on
    the init-weight target (answers repeat one token) its blocks are accepted whole and it drafts ahead
    (``repetitive_model_dir``)."""
    from transformers import LlavaForConditionalGeneration

    from specula.drafters import create
    from specula.drafters.eagle_head import EagleConfig, EagleHead

    head = EagleHead(EagleConfig.from_target(LlavaForConditionalGeneration.from_pretrained(model_dir)))
    h = head.config.hidden_size
    with torch.no_grad():
        head.fc.bias.zero_()
        head.fc.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return create({"kind": "eagle", "head": head.eval()}, target=target)


def test_requests_whose_drafter_drafts_ahead_overlap_and_the_others_draft_in_turn(repetitive_model_dir, processor):
    """Overlap is per session, on the chosen drafter's pipeline: eagle (a Lookahead chain) drafts ahead, the random
    tree cannot; batched together through one MultiDrafter replica, both give plain decoding's tokens."""
    from specula.drafters import create
    from specula.drafters.multi_drafter import MultiDrafter
    from specula.runtime.dataplane import DrafterServer, RemoteDrafter
    from specula.runtime.core.sampling import SamplingParams
    from specula.runtime.serve.verifier import VerifierEngine

    from serve_kit import world_requests

    target = load_target(repetitive_model_dir)
    V = target.info.vocab_size
    multi = MultiDrafter({"eagle": _pass_through_eagle(repetitive_model_dir, load_target(repetitive_model_dir)),
                          "rtree": create({"kind": "random", "vocab_size": V, "structure": "tree", "seed": 3})},
                         default="eagle")
    assert multi.spec.needs == {"hidden"} and multi.spec.structure == "tree"
    reqs = [replace(r, drafter=("eagle", "rtree")[i % 2])
            for i, r in enumerate(world_requests(processor, 4, SamplingParams(max_tokens=24), start=2))]
    plain = SpecEngine(load_target(repetitive_model_dir), None)
    want = {r.request_id: plain.generate([r])[r.request_id].tokens for r in reqs}
    verifier = VerifierEngine(target, RemoteDrafter(vocab_size=V, propose_timeout_s=120.0), gamma=GAMMA)
    got = {}
    try:
        with DrafterServer(multi, overlap=True) as server:
            assert server.info.overlap and tuple(server.info.drafters) == ("eagle", "rtree")

            def one(r):
                got[r.request_id] = verifier.generate(r, drafter_address=server.address)

            threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
    finally:
        verifier.close()
    for r in reqs:
        g = got[r.request_id]
        assert g["tokens"] == want[r.request_id] and g["metrics"]["drafter"] == r.drafter, r.request_id
        used = g["dataplane"]["spec_used"]
        assert (used > 0) if r.drafter == "eagle" else (used + g["dataplane"]["spec_dropped"] == 0), \
            (r.request_id, g["dataplane"])
