"""The one-machine default with every shipped drafter of the embedded target: the drafter and the vision tower in
the verifier (``drafter.colocate``, ``deployments.vision_encoder.colocate``), the drafter begun from an answer's
second token and its draft length chosen per step. Each kind reads something else of the request (flash and
aasd the projected features, massv and ensemble the pre-projector ones through their own projector, eagle and
msd the target's hidden states): answers equal plain decoding token for token, long ones are drafted and
one-word ones are not."""

from __future__ import annotations

import pytest

from serve_kit import world_body
from specula.runtime.config import load_config
from specula.runtime.serve import LocalApp

KINDS = ["flash", "eagle", "msd", "massv", "aasd", "ensemble"]
SAMPLES = (1, 7, 0, 4, 10)  # world_body's: two captions (24 tokens), a 3-token vqa answer, two 2-token charts


def _config(kind: str | None) -> object:
    dep = {"num_replicas": 1, "torch_threads": 1, "ray_actor_options": {"num_cpus": 0}}
    deployments = {k: dict(dep) for k in ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier")}
    deployments["vision_encoder"]["colocate"] = True
    drafter = {"colocate": True, "gamma": 4 if kind else 0, **({"kind": kind} if kind else {})}
    return load_config({"model": {"path": "target"}, "grpc": {"enabled": False}, "drafter": drafter,
                        "deployments": deployments})


@pytest.fixture(scope="module")
def plain():
    with LocalApp.from_config(_config(None)) as a:
        assert a.vision is None
        answers = {i: a.generate(world_body(i, max_tokens=24)) for i in SAMPLES}
        assert sorted(len(r["tokens"]) for r in answers.values())[:2] == [2, 2]  # the one-word cases are there
        yield answers


@pytest.mark.parametrize("kind", KINDS)
def test_every_shipped_drafter_in_the_verifier_with_its_tower_answers_as_plain_decoding(plain, kind):
    cfg = _config(kind)
    assert cfg.drafter.begin_after == 2 and cfg.drafter.adaptive
    with LocalApp.from_config(cfg) as a:
        assert a.vision is None and a.drafter is None and a.verifier.local is not None
        drafted, short = 0, 0
        for i, want in plain.items():
            got = a.generate(world_body(i, max_tokens=24))
            assert got["tokens"] == want["tokens"], (kind, i)
            if len(got["tokens"]) <= 2:  # a one-word answer (and its end): the drafter never began
                assert got["metrics"]["draft_tokens"] == 0, (kind, i)
                short += 1
            else:
                drafted += got["metrics"]["draft_tokens"]
        assert drafted > 0 and short == 2, kind
