"""The whole application in one process (LocalApp: ingress, vision, verifier, drafter over loopback gRPC):
an HTTP-shaped request gives the single-process engine's tokens and text, streamed or not; bad requests are
refused with the field or limit named."""

from __future__ import annotations

import base64

import pytest
import torch

from specula.runtime.engine import SpecEngine
from specula.runtime.serve import LocalApp, RequestError
from specula.runtime.serve.factory import make_drafter
from specula.runtime.serve.vision import VisionEngine
from specula.targets import load_target

from serve_kit import make_config, world_body


@pytest.fixture(scope="module")
def app(model_dir):
    cfg = make_config(model_dir, limits={"max_images": 4, "max_tokens": 64})
    with LocalApp.from_config(cfg) as a:
        yield a, cfg


def _reference(model_dir, cfg, app, body):
    """SpecEngine in one process, the target reading pixels itself (no separate vision step, no gRPC)."""
    req = app.ingress.prepare(app.ingress.parse(body), "ref")
    eng = SpecEngine(load_target(model_dir), make_drafter(cfg), gamma=cfg.drafter.gamma)
    return eng.generate([req])["ref"]


@pytest.mark.parametrize("sample", [0, 3, 2])  # one image, several images, text only
def test_generate_equals_the_single_process_engine(model_dir, app, sample):
    a, cfg = app
    body = world_body(sample, max_tokens=16)
    ref = _reference(model_dir, cfg, a, body)
    got = a.generate(body)
    assert got["tokens"] == ref.tokens
    assert got["text"] == a.ingress.tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert got["finish_reason"] == ref.finish_reason and got["drafter"] == "ok"
    assert got["usage"]["completion_tokens"] == len(ref.tokens)


def test_stream_records_rebuild_the_answer(app):
    a, _ = app
    body = world_body(1, max_tokens=16)
    whole = a.generate(body)
    records = list(a.stream({**body, "stream": True}))
    assert records[-1]["finished"] is True and records[-1]["finish_reason"] == whole["finish_reason"]
    assert [t for r in records[:-1] for t in r["tokens"]] == whole["tokens"]
    assert "".join(r["text"] for r in records[:-1]) == whole["text"]


def test_vision_batches_requests_without_changing_features(model_dir, processor):
    vision = VisionEngine(load_target(model_dir))
    pix = [processor.image_processor(images=[im], return_tensors="pt")["pixel_values"]
           for im in _images(3)]
    alone = [vision.encode(p).features for p in pix]
    together = vision.encode_many([(p, None) for p in pix])
    for a, b in zip(alone, together):
        assert torch.allclose(a, b.features, atol=1e-5)


def _images(n):
    from specula.world import generate

    out = []
    i = 0
    while len(out) < n:
        out += list(generate("vqa", "eval", i).images)
        i += 1
    return out[:n]


@pytest.mark.parametrize("body, match", [
    ({"prompt": "hi", "max_tokens": 4, "temprature": 0.5}, "temprature: unknown key"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens 1000 > the limit 64"),
    ({"prompt": "hi", "images": ["not base64!"]}, r"images\[0\]: not valid base64"),
    ({"prompt": "hi", "images": [base64.b64encode(b"GIF89a....").decode()]}, r"images\[0\]: cannot be decoded"),
    ({"prompt": "hi", "images": ["aGk="] * 5}, "5 images > max_images=4"),
    ({"prompt": "<image><image>two?", "images": []}, "2 '<image>' markers for 0 images"),
])
def test_bad_requests_are_refused_naming_the_problem(app, body, match):
    a, _ = app
    with pytest.raises(RequestError, match=match):
        a.generate(body)


def test_body_that_is_not_json_is_refused(app):
    a, _ = app
    with pytest.raises(RequestError, match="not JSON"):
        a.generate(b"{nope")
