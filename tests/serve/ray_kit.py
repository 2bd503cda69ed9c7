"""Helpers of the tests that start a real Ray (placement, autoscaling, faults): the environment Ray needs here,
bounded waits (never an unbounded ``serve.run`` or poll), and HTTP calls to the Serve proxy.

Ray 2.60 turns token authentication on for a new local cluster (and writes ~/.ray/auth_token) unless RAY_AUTH_MODE
is set, so ``ray_env`` sets RAY_AUTH_MODE=disabled before anything starts (workers inherit it); Ray's unix socket
paths must fit in 107 bytes, so its temp dir is a short one under /tmp; RAY_TMPDIR points there too, so files Ray
writes by default (the current-cluster address of ``ray.cluster_utils.Cluster``) stay out of the shared /tmp/ray.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def ray_env(extra: dict[str, str] | None = None) -> Iterator[str]:
    """Set Ray's environment for the block; yields a fresh short temp dir (removed after)."""
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    env = {**RAY_ENV, "RAY_TMPDIR": tmp, **(extra or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield tmp
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def serve_session(port: int, env: dict[str, str] | None = None, by_value: tuple = ()) -> Iterator[str]:
    """A local Ray (2 CPUs, no dashboard, a 128 MiB object store, ``ray_env(env)``'s temp dir) with Serve's HTTP
    proxy on 127.0.0.1:``port``; yields the proxy's base URL. ``by_value``: test modules whose classes the replicas
    unpickle (tests/ is not on their import path). On the way out Serve shuts down, then Ray (even when Serve's
    shutdown fails), then the environment is restored."""
    import ray
    from ray import serve

    with ray_env(env) as tmp:
        try:
            init_ray(num_cpus=2, include_dashboard=False, _temp_dir=tmp, object_store_memory=128 * 1024 * 1024,
                     log_to_driver=False, configure_logging=False)
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for module in by_value:
                ray.cloudpickle.register_pickle_by_value(module)
            yield f"http://127.0.0.1:{port}"
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_app(app, name: str, route_prefix: str = "/", timeout: float = 120.0):
    """``serve.run`` with a deadline (it waits forever for a replica that cannot be placed)."""
    from ray import serve

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(serve.run, app, name=name, route_prefix=route_prefix)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"application {name!r} not running after {timeout:.0f} s: {serve.status()}") from None
    finally:
        pool.shutdown(wait=False)


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 0.5):
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not reached within {timeout:.0f} s (last value {last!r})")


def replicas(app: str, deployment: str) -> int:
    """RUNNING replicas of a deployment, from ``serve.status()``."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return int(status.deployments[deployment].replica_states.get("RUNNING", 0))


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream_records(url: str, body: dict, timeout: float = 60) -> Iterator[dict]:
    """The NDJSON records of ``POST url`` with ``stream: true``, as they arrive."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.strip():
                yield json.loads(line)


def init_ray(attempts: int = 3, **kwargs):
    """``ray.init`` that retries a head node that did not register in time.

    Ray waits a fixed 30 s for its raylet to register with the GCS (and for the GCS's port file); on a loaded 2-core
    machine (a full test run, Ray processes of an earlier module still exiting) that wait sometimes runs out ("The
    current node timed out during startup", "Timed out waiting for file .../gcs_server_port_..."). That is the
    machine, not the code under test: shut down what started and try again."""
    import ray

    for attempt in range(attempts):
        try:
            return ray.init(**kwargs)
        except Exception as e:  # Ray raises a bare Exception for this
            if not _startup_timeout(e) or attempt == attempts - 1:
                raise
            ray.shutdown()
            time.sleep(2.0)


def start_cluster(attempts: int = 3, workers: tuple[dict, ...] = (), **head_node_args):
    """A ``ray.cluster_utils.Cluster`` with its head node and then one worker node per ``workers`` entry started and
    registered. A node that does not register within Ray's 30 s (loaded CI machines) fails the whole try: the partly
    started cluster is shut down (a late raylet of the failed node loses its GCS with it and exits) and a fresh one
    starts, up to ``attempts`` times."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(**head_node_args)  # the first node is the head
            for worker in workers:
                cluster.add_node(**worker)
            cluster.wait_for_nodes(timeout=60)
            return cluster
        except Exception as e:  # Ray raises a bare Exception for a node that timed out
            cluster.shutdown()
            if not _startup_timeout(e) or attempt == attempts - 1:
                raise
            time.sleep(2.0)


def _startup_timeout(e: Exception) -> bool:
    """Whether ``e`` is Ray's "node did not come up in time" (raylet registration, the GCS port file of a slow head
    node, or ``wait_for_nodes``)."""
    msg = str(e)
    return "timed out during startup" in msg or "Timed out waiting for file" in msg or isinstance(e, TimeoutError)
