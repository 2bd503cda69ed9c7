"""Concurrency: 16 streams at once, mixed drafters (ngram, random, text_lm), mixed sampling (greedy; seeded
temperature with and without top-p / top-k / min-p) and mixed front doors, through the real serving stack in one
process. Every stream completes, equals the same request run alone, and loses no token.

One application per drafter kind (a verifier serves one drafter): ``LocalApp`` (ingress, vision engine, the
continuous-batching ``VerifierEngine``, the drafter in a ``DrafterServer`` on loopback gRPC) plus the public gRPC
API (``grpc_api.py``, a real grpc.aio server) over the same engines. The doors:

    generate  POST /generate with stream: true (NDJSON records, ``LocalApp.stream``)   alone: the unary answer
    chat      POST /v1/chat/completions, stream: true + include_usage (SSE chunks)     alone: the unary answer
    grpc      Specula/GenerateStream over a real channel                              alone: Specula/Generate

Requests of one kind share their verifier's batch; requests join and leave it as they come and finish. Greedy
streams equal their solo runs exactly: verification is exact, and an argmax does not move with the ~1e-5 the
batch changes in fp32 logits. Seeded sampled streams use only their own generators (the target's and the
drafter's), whatever shares the batch (runtime/core/sampling.py), so they equal their solo runs too, except when a
uniform lands within those ~1e-5 of a CDF boundary: the forward passes (target and drafter, over padded batches of
another shape) are not bitwise batch-invariant on CPU, so that draw flips and the stream goes its own (equally
lossless) way. Measured: 2 of 1,200 sampled streams in a 300 s soak (a case: text_lm, world sample 1, seed 3111,
temperature 0.8, 22 tokens, batched with any other request: its 37th draft draw sees q moved by 2.4e-6 and takes
token 659 instead of 661). So sampled streams must equal their solo runs but for a few: a seed that were ignored or
a generator shared between rows would make nearly all differ. The drafters run without draft-ahead
(``overlap: false``): with it, how far drafting ran ahead depends on timing, so a seeded sampled run is lossless
but not repeatable at all (tests/serve/test_every_drafter_distributed.py).

CI runs 2 rounds of 16 streams; ``SPECULA_LONG=1`` keeps starting rounds for 300 s.
"""

from __future__ import annotations

import json
import time

import pytest

from specula.runtime.api_client import SpeculaClient
from specula.runtime.serve import LocalApp

from reliability_kit import record_figure, scale
from reliability_serving import (EventLoopThread, build_weights, chat_body, drafter_options, make_config,
                                 run_threads, serve_grpc, world_body)

pytestmark = pytest.mark.integration
KINDS = ("ngram", "random", "text_lm")
DOORS = ("generate", "chat", "grpc")
STREAMS = 16
ROUNDS, SOAK_S = scale(2, 1_000_000), scale(0, 300)
PARAMS = (  # greedy, then seeded sampling with each filter
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 11},
    {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 12},
    {"temperature": 0.7, "min_p": 0.05, "seed": 13},
)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    root = build_weights(tmp_path_factory)
    loop = EventLoopThread()
    out, servers = {}, []
    try:
        for kind in KINDS:
            cfg = make_config(root / "target", drafter_options(kind, root),
                              limits={"max_tokens": 64, "max_images": 5})
            app = LocalApp.from_config(cfg)
            _record_batches(app.verifier.target)
            _, server = serve_grpc(loop, cfg, app)
            servers.append(server)
            out[kind] = (app, SpeculaClient(f"127.0.0.1:{server.port}", timeout=300))
        yield out
    finally:
        for app, client in out.values():
            client.close()
        for s in servers:
            loop.call(s.stop(grace=1.0))
        loop.close()
        for app, _ in out.values():
            app.close()


def _record_batches(target) -> None:
    """Count the largest batch the target verified (the streams really shared it)."""
    target.widest = 0
    verify = target.verify

    def recording(block):
        target.widest = max(target.widest, len(block.request_ids))
        return verify(block)

    target.verify = recording  # decode_step goes through verify too


def _spec(round_: int, i: int) -> tuple[str, str, dict]:
    """Stream i of a round: (drafter kind, door, POST /generate-style body with its sampling parameters)."""
    kind, door = KINDS[i % 3], DOORS[(i // 3) % 3]
    params = dict(PARAMS[(i + round_) % 4])
    if door == "generate":  # /generate takes temperature and seed only
        params = {k: v for k, v in params.items() if k in ("temperature", "seed")}
    if "seed" in params:
        params["seed"] += 100 * round_
    body = {**world_body((i + 5 * round_) % 12, max_tokens=12 + (5 * i + round_) % 13), **params}
    return kind, door, body


def _grpc_args(body: dict) -> tuple[str, list[bytes], dict]:
    import base64

    params = {k: v for k, v in body.items() if k not in ("prompt", "images")}
    return body["prompt"], [base64.b64decode(s) for s in body["images"]], params


def _alone(stacks, kind: str, door: str, body: dict) -> dict:
    """The request run alone, unary: {"tokens" (None for chat), "text", "completion_tokens", "finish"}."""
    app, client = stacks[kind]
    if door == "generate":
        r = app.generate(body)
        return {"tokens": r["tokens"], "text": r["text"], "completion_tokens": r["usage"]["completion_tokens"],
                "finish": r["finish_reason"]}
    if door == "chat":
        r = app.openai("chat", chat_body(body))
        return {"tokens": None, "text": r["choices"][0]["message"]["content"],
                "completion_tokens": r["usage"]["completion_tokens"], "finish": r["specula"]["finish_reason"]}
    prompt, images, params = _grpc_args(body)
    r = client.generate(prompt, images, **params)
    return {"tokens": r.tokens, "text": r.text, "completion_tokens": r.usage["completion_tokens"],
            "finish": r.finish_reason}


def _streamed(stacks, kind: str, door: str, body: dict) -> dict:
    """The request streamed: what the pieces add up to, and what the last piece says."""
    app, client = stacks[kind]
    if door == "generate":
        records = list(app.stream({**body, "stream": True}))
        last = records[-1]
        assert last.get("finished") and all(not r.get("finished") for r in records[:-1]), records
        pieces = records[:-1]
        return {"tokens": [t for r in pieces for t in r["tokens"]], "text": "".join(r["text"] for r in pieces),
                "completion_tokens": last["usage"]["completion_tokens"], "finish": last["finish_reason"],
                "drafter": last["drafter"]}
    if door == "chat":
        chunks = app.openai("chat", {**chat_body(body), "stream": True, "stream_options": {"include_usage": True}})
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and chunks[-1]["choices"] == [], chunks[-3:]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        return {"tokens": None, "text": text, "completion_tokens": chunks[-1]["usage"]["completion_tokens"],
                "finish": finals[0]["specula"]["finish_reason"], "drafter": finals[0]["specula"]["drafter"]}
    prompt, images, params = _grpc_args(body)
    chunks = list(client.stream(prompt, images, **params))
    last = chunks[-1]
    assert last.finished and not any(c.finished for c in chunks[:-1])
    return {"tokens": [t for c in chunks for t in c.tokens], "text": "".join(c.text for c in chunks),
            "completion_tokens": last.usage["completion_tokens"], "finish": last.finish_reason,
            "drafter": last.drafter}


def test_sixteen_mixed_streams_equal_their_solo_runs(stacks):
    alone: dict[str, dict] = {}  # (kind, door, body) -> the solo answer
    streams = sampled = sampled_same = greedy = tokens = 0
    rounds = 0
    t0 = time.monotonic()
    while rounds < ROUNDS and (rounds < 2 or time.monotonic() - t0 < SOAK_S):
        specs = [_spec(rounds, i) for i in range(STREAMS)]
        keys = [json.dumps([k, d, b], sort_keys=True) for k, d, b in specs]
        for key, (kind, door, body) in zip(keys, specs):
            if key not in alone:
                alone[key] = _alone(stacks, kind, door, body)
        got = run_threads([lambda s=s: _streamed(stacks, *s) for s in specs], bound_s=600)
        for key, (kind, door, body), g in zip(keys, specs, got):
            where = (rounds, kind, door, {k: v for k, v in body.items() if k != "images"})
            assert not isinstance(g, BaseException), (where, g)
            assert g["finish"] in ("length", "eos"), (where, g)  # complete: never cut, never an error
            assert g["drafter"] == "ok", (where, g["drafter"])  # it really drafted, never decoded alone
            if g["tokens"] is not None:  # 0 tokens lost: the pieces add up to the count the last one reports
                assert len(g["tokens"]) == g["completion_tokens"] >= 1, where
            want = alone[key]
            same = g["text"] == want["text"] and g["tokens"] == want["tokens"] and \
                (g["finish"], g["completion_tokens"]) == (want["finish"], want["completion_tokens"])
            if body.get("temperature", 0.0) > 0:
                sampled += 1
                sampled_same += same
            else:
                greedy += 1
                assert same, (where, g, want)
            tokens += g["completion_tokens"]
        streams += len(specs)
        rounds += 1
    assert sampled_same >= 0.8 * sampled, f"only {sampled_same} of {sampled} seeded sampled streams equal alone"
    widest = {kind: app.verifier.target.widest for kind, (app, _) in stacks.items()}
    assert min(widest.values()) >= 2, widest  # each verifier batched concurrent streams
    for app, _ in stacks.values():  # every request left its verifier
        assert not app.verifier.engine.rows and not app.verifier.target.live_ids
    elapsed = time.monotonic() - t0
    record_figure(
        "test_sixteen_mixed_streams_equal_their_solo_runs",
        f"{streams}/{streams} concurrent streams complete ({STREAMS} at a time, {rounds} rounds, drafters "
        f"{'/'.join(KINDS)}, doors {'/'.join(DOORS)}); equal to their solo runs: greedy {greedy}/{greedy}, "
        f"seeded sampled {sampled_same}/{sampled}; {tokens} tokens, 0 lost; widest verified batch {widest}; "
        f"{elapsed:.0f} s",
        streams=streams, streams_complete=streams, at_a_time=STREAMS, rounds=rounds, greedy=greedy,
        greedy_equal=greedy, sampled=sampled, sampled_equal=sampled_same, tokens=tokens, tokens_lost=0,
        widest_batch=widest, seconds=round(elapsed, 1))
