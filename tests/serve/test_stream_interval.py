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
