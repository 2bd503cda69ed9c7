"""``drafter.colocate``: the drafter runs inside the verifier (no DrafterService, no data plane). Answers equal
plain decoding token for token (greedy) and the single-process engine's blocks, drafts are made and rejected,
a request's metrics name the drafter it chose, and the served application's stream is unchanged."""

from __future__ import annotations

import pytest

from serve_kit import make_config, world_body
from specula.runtime.engine.factory import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import LocalApp
from specula.targets import load_target


@pytest.fixture(scope="module")
def app(model_dir):
    """Fixed draft length (adaptive off), so its blocks can be compared with the single-process engine's."""
    cfg = make_config(model_dir, drafter={"colocate": True, "adaptive": False,
                                          "alternatives": {"short": {"kind": "ngram", "options": {"max_n": 2}}}})
    with LocalApp.from_config(cfg) as a:
        assert a.drafter is None and a.verifier.remote is None and a.verifier.local is not None
        assert a.verifier.engine.policy is None and a.verifier.engine.begin_after == cfg.drafter.begin_after > 1
        yield a, cfg


def test_the_adaptive_colocated_verifier_answers_as_plain_decoding(model_dir):
    """The default: draft lengths chosen per step from measured costs (so blocks vary run to run; tokens never)."""
    cfg = make_config(model_dir, drafter={"colocate": True})
    target = load_target(model_dir)
    with LocalApp.from_config(cfg) as a:
        assert a.verifier.engine.policy is not None
        for sample in range(6):
            body = world_body(sample, max_tokens=24)
            req = a.ingress.prepare(a.ingress.parse(body), "ref")
            assert a.generate(body)["tokens"] == SpecEngine(target, None, gamma=0).generate([req])["ref"].tokens


@pytest.mark.parametrize("sample", [0, 1, 2, 3, 4, 5])
def test_colocated_answers_equal_plain_decoding_and_the_single_process_engine(model_dir, app, sample):
    a, cfg = app
    body = world_body(sample, max_tokens=24)
    req = a.ingress.prepare(a.ingress.parse(body), "ref")
    target = load_target(model_dir)
    plain = SpecEngine(target, None, gamma=0).generate([req])["ref"]
    spec = SpecEngine(target, make_drafter(cfg), gamma=cfg.drafter.gamma,  # begun as late as the config says
                      begin_after=cfg.drafter.begin_after).generate([req])["ref"]
    got = a.generate(body)
    assert got["tokens"] == plain.tokens == spec.tokens
    m = got["metrics"]
    assert m["blocks"] == spec.metrics.blocks and m["accepted_tokens"] == spec.metrics.accepted_tokens
    assert m["drafter"] == "ngram" and got["drafter"] == "ok"


def test_drafts_are_made_accepted_and_rejected_over_the_prompts(app):
    a, _ = app
    drafted = accepted = 0
    for sample in range(6):
        m = a.generate(world_body(sample, max_tokens=24))["metrics"]
        drafted, accepted = drafted + m["draft_tokens"], accepted + m["accepted_tokens"]
    assert drafted > 0 and 0 < accepted < drafted


def test_a_request_naming_an_alternative_drafts_with_it(app):
    a, _ = app
    got = a.generate({**world_body(1, max_tokens=16), "drafter": "short"})
    assert got["metrics"]["drafter"] == "short"
    assert got["tokens"] == a.generate(world_body(1, max_tokens=16))["tokens"]


@pytest.mark.parametrize("drafter_colocate", [True, False])
def test_images_encoded_in_the_verifier_answer_as_with_a_vision_encoder(model_dir, app, drafter_colocate):
    """``deployments.vision_encoder.colocate``: no VisionEngine; the verifier's target encodes the pixels itself
    (the default on one CPU node), with the drafter in the verifier or behind the data plane. Answers equal the app
    with a VisionEncoder's features, token for token."""
    separate, _ = app
    cfg = make_config(model_dir, drafter={"colocate": drafter_colocate, "adaptive": False, "begin_after": 2},
                      deployments={k: {"num_replicas": 1, "torch_threads": 1, "ray_actor_options": {"num_cpus": 0},
                                       **({"colocate": True} if k == "vision_encoder" else {})}
                                   for k in ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier")})
    assert cfg.deployments.vision_encoder.colocate is True
    with LocalApp.from_config(cfg) as a:
        assert a.vision is None
        drafted = 0
        for sample in range(4):
            body = world_body(sample, max_tokens=16)
            got, want = a.generate(body), separate.generate(body)
            assert got["tokens"] == want["tokens"] and got["drafter"] == "ok"
            drafted += got["metrics"]["draft_tokens"]
            if drafter_colocate:  # the same engine, drafting the same blocks
                assert got["metrics"]["accepted_tokens"] == want["metrics"]["accepted_tokens"]
        assert drafted > 0 and (a.drafter is None) == drafter_colocate
