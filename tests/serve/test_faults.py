"""Faults on a real local Ray Serve, replicas killed with SIGKILL mid-answer (their pids from ``placement()``):

- the DrafterEnsemble replica dies while a streamed request is decoding: the answer is still token for token plain
  decoding (the verifier goes on alone and says so under "drafter"); Serve restarts the replica and speculation
  resumes on later requests;
- the TargetVerifier replica dies mid-answer: the HTTP client gets an explicit error record and no "finished"
  record (never a silently short answer); Serve restarts it and the next request is answered in full.

(The same drafter death without Ray, verifier and drafter in one process: test_verifier_dataplane.py.)
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import IngressEngine
from specula.targets import load_target

from ray_kit import free_port, post, run_app, serve_session, stream_records, wait_for
from serve_kit import make_config, record_figure, world_body

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

MAX_TOKENS = 300  # the tiny random model never stops early: long enough to be killed mid-answer
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def served(model_dir):
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = make_config(model_dir, http={"host": "127.0.0.1", "port": port})
    with serve_session(port) as url:
        run_app(build_app(cfg), cfg.name)
        yield cfg, url


@pytest.fixture(scope="module")
def plain(served, model_dir):
    """Plain target decoding of a request body (the answer every run must give)."""
    cfg, _ = served
    ingress = IngressEngine.from_config(cfg)
    target = load_target(model_dir)

    def run(body: dict) -> list[int]:
        return SpecEngine(target, None, gamma=0).generate([ingress.prepare(ingress.parse(body), "ref")])["ref"].tokens

    return run


def _pid(app: str, deployment: str) -> int | None:
    from ray import serve

    try:
        return serve.get_deployment_handle(deployment, app_name=app).placement.remote().result(timeout_s=10)["pid"]
    except Exception:  # no live replica yet
        return None


def _new_replica(app: str, deployment: str, dead: int) -> int:
    return wait_for(f"a new {deployment} replica after killing pid {dead}",
                    lambda: (p := _pid(app, deployment)) not in (None, dead) and p, DEADLINE_S)


def _stream_killing(url: str, body: dict, pid: int) -> list[dict]:
    """Stream ``body``, SIGKILL ``pid`` as soon as the first record arrives, read to the end."""
    records = []
    for record in stream_records(f"{url}/generate", body, timeout=DEADLINE_S):
        records.append(record)
        if len(records) == 1:
            os.kill(pid, signal.SIGKILL)
    return records


def test_drafter_killed_mid_generation_output_unchanged_then_speculation_resumes(served, plain):
    cfg, url = served
    body = world_body(1, max_tokens=MAX_TOKENS)  # a caption of one image
    want = plain(body)
    dead = _pid(cfg.name, "DrafterEnsemble")
    records = _stream_killing(url, body, dead)
    final = records[-1]
    assert final.get("finished") is True, final
    assert [t for r in records[:-1] for t in r["tokens"]] == want  # not one token different
    assert final["drafter"].startswith("fallback"), final["drafter"]  # the drafter really died mid-answer
    assert final["usage"]["completion_tokens"] == MAX_TOKENS

    _new_replica(cfg.name, "DrafterEnsemble", dead)

    def resumed():
        status, raw = post(f"{url}/generate", body)
        assert status == 200, raw[:300]
        got = json.loads(raw)
        assert got["tokens"] == want  # while the drafter comes back, answers stay exact
        return got["drafter"] == "ok"

    wait_for("speculation resumed with the restarted drafter replica", resumed, DEADLINE_S, every=1.0)
    record_figure("test_drafter_killed_mid_generation_output_unchanged_then_speculation_resumes",
            f"drafter replica killed mid-generation: {len(want)}/{MAX_TOKENS} tokens identical to plain decoding "
            f"(drafter: {final['drafter']}); speculation resumed on the restarted replica",
            tokens=MAX_TOKENS, tokens_identical=len(want), resumed=True)


def test_verifier_killed_mid_request_gives_an_error_record_and_the_service_recovers(served, plain):
    cfg, url = served
    body = world_body(2, max_tokens=MAX_TOKENS)  # text only
    dead = _pid(cfg.name, "TargetVerifier")
    records = _stream_killing(url, body, dead)
    assert records[0]["tokens"]  # the answer had begun ...
    assert records[-1].get("error", {}).get("message"), records[-1]  # ... and ends with an explicit error record
    assert not any(r.get("finished") for r in records)
    assert sum(len(r.get("tokens", ())) for r in records) < MAX_TOKENS

    _new_replica(cfg.name, "TargetVerifier", dead)
    status, raw = post(f"{url}/generate", body, timeout=DEADLINE_S)
    assert status == 200, raw[:300]
    assert json.loads(raw)["tokens"] == plain(body)
    before = sum(len(r.get("tokens", ())) for r in records)
    record_figure("test_verifier_killed_mid_request_gives_an_error_record_and_the_service_recovers",
            f"verifier replica killed mid-answer: explicit error record after {before}/{MAX_TOKENS} tokens, no "
            f"'finished' record; the next request answered in full ({MAX_TOKENS} tokens, equal to plain decoding)",
            tokens_before_error=before, tokens=MAX_TOKENS, error_records=1, recovered=True)
