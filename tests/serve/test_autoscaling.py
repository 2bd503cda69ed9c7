"""Autoscaling on a real local Ray Serve: the TargetVerifier (``autoscaling_config`` min 1, max 2, target 1 ongoing
request) goes to 2 replicas while four HTTP clients keep it busy, every answer meanwhile equals plain decoding, and
it goes back to 1 replica once the load stops. Replica counts come from ``serve.status()``; each wait fails with a
clear message after 120 s.

Serve's defaults make this slow (handles and replicas push metrics every 10 s, averaged over a 30 s look-back), so
the test shortens the push intervals through Serve's environment variables (set before Ray starts; every Serve
process inherits them) and the upscale/downscale delays through the config. The look-back window is not a Specula
config field, so it stays 30 s: here the scale-up took 15-20 s and the scale-down 8-34 s. The drafter is off (gamma 0): the
verifier is the deployment under test and the cheapest one to replicate.
"""

from __future__ import annotations

import threading
import time

import pytest

from specula.runtime.config import load_config
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import IngressEngine
from specula.targets import load_target

from ray_kit import free_port, replicas, run_app, serve_session, stream_records, wait_for
from serve_kit import make_config, world_body

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
              pytest.mark.filterwarnings("ignore:.*look_back_period_s.*:FutureWarning")]

FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
               "upscale_delay_s": 1.0, "downscale_delay_s": 3.0,
               "look_back_period_s": 2.0}
DEADLINE_S = 120.0


def _config(model_dir, port: int):
    raw = make_config(model_dir, {"gamma": 0}, http={"host": "127.0.0.1", "port": port}).model_dump(mode="json")
    verifier = raw["deployments"]["target_verifier"]
    verifier.pop("num_replicas")
    verifier.update(autoscaling_config=AUTOSCALING, max_ongoing_requests=8)
    return load_config(raw)


@pytest.fixture(scope="module")
def served(model_dir):
    pytest.importorskip("ray")
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = _config(model_dir, port)
    with serve_session(port, FAST_METRICS) as url:
        run_app(build_app(cfg), cfg.name)
        yield cfg, url


def test_verifier_scales_up_under_load_and_back_down_when_idle(served, model_dir):
    cfg, url = served
    body = world_body(2, max_tokens=48)  # text only: the verifier's work
    ingress = IngressEngine.from_config(cfg)
    want = SpecEngine(load_target(model_dir), None, gamma=0).generate(
        [ingress.prepare(ingress.parse(body), "ref")])["ref"].tokens
    app, name = cfg.name, "TargetVerifier"
    assert replicas(app, name) == 1

    stop, answers, errors = threading.Event(), [], []

    def client():
        while not stop.is_set():
            try:
                records = list(stream_records(f"{url}/generate", body, timeout=60))
                assert records[-1].get("finished"), records[-1]
                answers.append([t for r in records[:-1] for t in r["tokens"]])
            except Exception as e:  # reported below: a failed request fails the test
                errors.append(repr(e))
                return

    clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    start = time.monotonic()
    for t in clients:
        t.start()
    try:
        wait_for("TargetVerifier scaled up to 2 replicas under load",
                 lambda: replicas(app, name) >= 2 or errors, DEADLINE_S)
        up = time.monotonic() - start
        n = len(answers)
        wait_for("requests served with 2 replicas", lambda: len(answers) >= n + 4 or errors, 60)
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    assert not errors, errors[:3]
    idle = time.monotonic()
    wait_for("TargetVerifier scaled back down to 1 replica when idle", lambda: replicas(app, name) == 1, DEADLINE_S)
    down = time.monotonic() - idle
    print(f"\nautoscaling: 1 -> 2 replicas {up:.1f} s after the load began, 2 -> 1 {down:.1f} s after it stopped; "
          f"{len(answers)} answers")
    assert answers and all(a == want for a in answers)  # every answer, on either replica, is plain decoding's
