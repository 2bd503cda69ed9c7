"""``specula serve`` as a user runs it: a subprocess on a free port with a tiny model, answering ``POST /generate``;
SIGTERM (what a process supervisor sends) makes it print its shutdown lines, stop Serve and Ray, free the port and
exit 0, within a bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error

import pytest
import yaml

from ray_kit import RAY_ENV, free_port, post, ray_env, wait_for
from serve_kit import make_config, world_body

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_S, STOP_S = 150.0, 60.0


def _ready(url: str, proc: subprocess.Popen, log) -> bool:
    """It said it is serving (the application is RUNNING) and it answers."""
    if proc.poll() is not None:
        raise AssertionError(f"specula serve exited with {proc.returncode} before answering:\n{log()}")
    if "specula: serving" not in log():
        return False
    try:
        status, raw = post(url, world_body(2, max_tokens=8), timeout=30)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # not listening yet
    if status in (404, 502, 503):
        return False  # the proxy is up, the application is not ready yet
    assert status == 200, raw[:500]
    return len(json.loads(raw)["tokens"]) == 8


def _local_ray_facts(root: int) -> dict:
    """The niceness of the TargetVerifier replica(s) among ``root``'s descendants, whether a dashboard with its
    frontend runs, and Serve's HTTP proxies."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    todo, cmds = [root], {}
    while todo:
        pid = todo.pop()
        try:
            cmds[pid] = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        todo += children.get(pid, [])
    return {"verifier_nice": [os.getpriority(os.PRIO_PROCESS, p) for p, c in cmds.items() if "TargetVerifier" in c],
            "dashboard": [c[:120] for c in cmds.values()  # Ray keeps a head without its UI modules
                          if "dashboard/dashboard.py" in c and "--disable-frontend" not in c],
            "proxies": [c[:120] for c in cmds.values() if c.startswith("ray::ProxyActor")]}


def test_sigterm_shuts_down_gracefully(model_dir, tmp_path):
    port = free_port()
    cfg = make_config(model_dir, {"gamma": 0}, http={"host": "127.0.0.1", "port": port})  # no drafter: starts faster
    path = tmp_path / "specula.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    out = tmp_path / "serve.log"
    with ray_env() as tmp, open(out, "wb") as sink:
        env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "specula.cli", "serve", "--config", str(path), "--num-cpus", "2",
               "--ray-temp-dir", tmp]
        # its own process group: if the test fails, everything it started goes with it
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log = out.read_text
        try:
            wait_for("specula serve answering POST /generate",
                     lambda: _ready(f"http://127.0.0.1:{port}/generate", proc, log), START_S, every=1.0)
            quiet = _local_ray_facts(proc.pid)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"specula serve still running {STOP_S:.0f} s after SIGTERM:\n{log()}") from None
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    text = log()
    assert rc == 0, text[-3000:]
    # the local Ray is kept quiet for the decoding beside it (launch.LOCAL_RAY_ENV): replicas at normal priority,
    # not Ray's nice 15, and no dashboard
    assert quiet["verifier_nice"] == [0], quiet
    assert not quiet["dashboard"], quiet
    assert "HTTP from the ingress replica" in text  # http.direct: the replica is the door, Serve runs no proxy
    assert not quiet["proxies"], quiet
    assert "specula: serving 'specula'" in text
    assert "specula: shutting down" in text and text.rstrip().endswith("specula: stopped"), text[-3000:]
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # Serve's proxy is gone with it
        post(f"http://127.0.0.1:{port}/generate", world_body(2, max_tokens=8), timeout=5)
    print(f"\nspecula serve: exited 0 {took:.1f} s after SIGTERM")
