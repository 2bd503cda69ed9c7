"""``specula serve`` fits the machine it starts on: with the default config (no --config) and Ray limited to 2 CPUs
it comes up, answers an image question over HTTP and stops; a config whose replica cannot be placed ends the start
with a message naming the deployment, what it asks, what the cluster has and the field to change, and a non-zero
exit: at once on its own local Ray, and by the placement watchdog when joined to a cluster."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from ray_kit import RAY_ENV, free_port, post, ray_env, start_cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
START_S, STOP_S, REFUSE_S = 300.0, 90.0, 60.0


def _spawn(args: list[str], log: Path, tmp: str) -> subprocess.Popen:
    env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as sink:  # its own process group: if the test fails, everything it started goes with it
        return subprocess.Popen([sys.executable, "-m", "specula.cli", "serve", *args], stdout=sink,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _refused(args: list[str], log: Path, tmp: str) -> int:
    """``specula serve args``'s exit code, which must come within REFUSE_S seconds."""
    proc = _spawn(args, log, tmp)
    try:
        return proc.wait(timeout=REFUSE_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {REFUSE_S:.0f} s:\n{log.read_text()[-3000:]}") from None
    finally:
        _reap(proc)


def _health(url: str, proc: subprocess.Popen, log: Path) -> bool:
    """It said it is serving (the application is RUNNING; the ingress may answer a moment before) and /health
    answers."""
    if proc.poll() is not None:
        raise AssertionError(f"specula serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
    if "specula: serving" not in log.read_text():
        return False
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_the_default_config_serves_an_image_question_on_two_cpus(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with ray_env() as tmp:
        started = time.monotonic()
        proc = _spawn(["--num-cpus", "2", "--port", str(port), "--grpc-port", "0", "--ray-temp-dir", tmp], log, tmp)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for("specula serve serving and answering /health", lambda: _health(url, proc, log), START_S,
                     every=1.0)
            up = time.monotonic() - started
            png = base64.b64encode((ROOT / "world" / "assets" / "sample.png").read_bytes()).decode()
            body = {"max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": "What colour is the star? Answer with one word."}]}]}
            status, raw = post(f"{url}/v1/chat/completions", body, timeout=120)
            assert status == 200, raw[:500]
            answer = json.loads(raw)
            assert answer["choices"][0]["message"]["content"].strip()
            assert answer["usage"]["prompt_tokens"] > 100  # the image's tokens are in the prompt
            assert answer["specula"]["metrics"]["drafter"] == "flash"  # the default drafter, in the verifier
            text = {"max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "What is 2 times 4?"}]}
            status, raw = post(f"{url}/v1/chat/completions", text, timeout=120)
            assert status == 200, raw[:500]
            assert json.loads(raw)["specula"]["metrics"]["drafter"] == "msd"  # drafter.text_only: no image
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=STOP_S)
        finally:
            _reap(proc)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert ("specula: serving 'specula' (model target, drafter flash (msd for requests without images), gamma 8, "
            "drafting in the verifier, "
             "vision in the verifier, verifier in the ingress, HTTP from the ingress replica)" in text
            and "cannot place" not in text)
    assert text.rstrip().endswith("specula: stopped"), text[-3000:]
    print(f"\nspecula serve (default config, 2 CPUs): serving and /health answering {up:.0f} s after start; "
          f"the answer was {answer['choices'][0]['message']['content']!r}")


def _too_big(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "too-big.yaml"
    path.write_text(yaml.safe_dump({"http": {"port": port}, "grpc": {"port": 0},
                                    "deployments": {"target_verifier": {"ray_actor_options": {"num_cpus": 4}}}}))
    return path


def test_a_replica_bigger_than_the_local_ray_is_refused_at_once(tmp_path):
    log = tmp_path / "serve.log"
    with ray_env() as tmp:
        started = time.monotonic()
        rc = _refused(["--config", str(_too_big(tmp_path, free_port())), "--num-cpus", "2", "--ray-temp-dir", tmp],
                      log, tmp)
        took = time.monotonic() - started
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert "specula: cannot place application 'specula' on a local Ray on this machine (2 CPU in all" in text, text
    assert ("TargetVerifier (deployments.target_verifier) asks 4 CPU per replica, more than any node has (the "
            "largest has 2 CPU): lower deployments.target_verifier.ray_actor_options.num_cpus") in text, text
    assert "specula: serving" not in text and "Started a local Ray instance" not in text  # refused before Ray
    assert took < REFUSE_S
    print(f"\nrefused {took:.0f} s after the start:\n" + "\n".join(
        line for line in text.splitlines() if line.startswith(("specula:", "  - "))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")
def test_the_watchdog_ends_a_start_that_a_cluster_cannot_place(tmp_path):
    """Joined to a cluster the same config is deployed (an autoscaler might add a node); Serve then reports the
    verifier waiting for resources, and the watchdog gives up, deletes the application and exits 1."""
    import ray
    from ray import serve

    log = tmp_path / "serve.log"
    with ray_env() as tmp:
        cluster = start_cluster(temp_dir=tmp, include_dashboard=False, num_cpus=2,
                                object_store_memory=80 * 1024 * 1024)
        try:
            proc = _spawn(["--config", str(_too_big(tmp_path, free_port())), "--address", cluster.address,
                           "--placement-timeout", "1"], log, tmp)
            try:
                rc = proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running after 180 s:\n{log.read_text()[-3000:]}") from None
            finally:
                _reap(proc)
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            try:
                left = serve.status().applications
            finally:
                ray.shutdown()
        finally:
            cluster.shutdown()
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert "specula: deploying anyway: the cluster may scale up" in text, text[-3000:]
    assert "specula: Serve could not place application 'specula' within" in text, text[-3000:]
    assert ("TargetVerifier (deployments.target_verifier) waits for resources: each replica asks 4 CPU; change "
            "deployments.target_verifier.ray_actor_options.num_cpus") in text, text[-3000:]
    assert "specula" not in left  # the half-started application is deleted; the cluster keeps running
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith(("specula:", "  - "))))


def test_a_taken_http_port_is_refused_before_ray_starts(tmp_path):
    """The port the application would serve on (the ingress replica's own, http.direct) is held by another
    process: one line naming it and the flag, exit 1, no Ray started (not a replica failing its start)."""
    log = tmp_path / "serve.log"
    with socket.socket() as holder, ray_env() as tmp:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc = _refused(["--port", str(port), "--grpc-port", "0", "--ray-temp-dir", tmp], log, tmp)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert f"specula: cannot serve HTTP on 127.0.0.1:{port}: address already in use; choose a free port with " \
           "--port (http.port)" in text, text
    assert "Started a local Ray instance" not in text
